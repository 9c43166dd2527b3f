"""The embedding and the LM head cut by vocabulary rows over the tensor ranks (TP > 1 only; at
TP=1 the model keeps nn.Embedding and its Linear head, untouched).

Each rank holds ceil(vocab / tp) consecutive rows (the last rank's tail zero-padded). Lookup: a
rank embeds the ids in its range, zeros the others, and the all-reduce sums the one non-zero row
per token. Logits: each rank's [n, rows] block, all-gathered to [n, vocab] on every tensor rank
(the sampling rank reads them; the others must take part in the collective)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.distributed.comm import tp_all_gather_last_dim, tp_all_reduce
from kiln.distributed.parallel_state import ParallelContext
from kiln.layers.linear import TensorSplit


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self, vocab_size: int, hidden_size: int, ctx: ParallelContext, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        self.ctx, self.vocab_size = ctx, vocab_size
        self.rows = -(-vocab_size // ctx.tp_size)
        self.start = ctx.tp_rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size, dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden]
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return tp_all_reduce(self.ctx, hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        return self.gather_logits(F.linear(hidden, self.weight))

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:  # [n, rows] -> [n, vocab]
        """Every rank's logits of its rows (this table's, or a head's cut as row_split cuts
        it), all-gathered on every tensor rank, the padding dropped."""
        return tp_all_gather_last_dim(self.ctx, local)[:, : self.vocab_size]

    def row_split(self) -> TensorSplit:
        """This rank's rows as a column-parallel Linear's cut: a float8 LM head's, whose
        Linear.cut zero-pads the vocabulary to rows x ranks as this table is."""
        full = self.rows * self.ctx.tp_size
        return TensorSplit(self.ctx, rows=((self.start, self.rows),), full_sizes=(full,))

    def cut(self, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the full [vocab, hidden] table, zero-padded to `rows`."""
        part = loaded[self.start : self.start + self.rows]
        if part.shape[0] == self.rows:
            return part
        pad = loaded.new_zeros(self.rows - part.shape[0], loaded.shape[1])
        return torch.cat([part, pad])

    def extra_repr(self) -> str:
        return f"rows {self.start}..{self.start + self.rows} of {self.vocab_size}"
