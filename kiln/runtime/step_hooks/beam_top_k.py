"""Beam search's rows: each search's best continuations, selected on the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.interfaces import BeamCandidates, BeamRow
from kiln.runtime.in_flight import InFlightStep, StepOutputs
from kiln.runtime.step_hooks.base import StepHook
from kiln.sampling.beam import BeamTopK, beam_top_k
from kiln.sampling.host_copy import to_device


@dataclass
class _BeamStep:
    top: BeamTopK  # on the device
    owners: list[tuple[str, list[int]]]  # per group: (the request that carries it, its beams)
    host: tuple[torch.Tensor, ...] | None = None  # top's scores, rows, token ids on the host


class BeamTopKRows(StepHook):
    """A step's beam-search rows (SchedulerOutput.beam_rows) turn into their searches' best
    continuations on the device (kiln.sampling.beam), copied to the host with the sampled ids:
    the host gets `keep` candidates a search, not W x vocab log-probabilities."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._steps: dict[InFlightStep, _BeamStep] = {}

    def on_logits(self, step: InFlightStep, logits: torch.Tensor) -> torch.Tensor:
        """A search whose rows are all in this step (the usual case: its forks are admitted
        together) is one group; one split over steps (short of sequence slots or blocks) gets a
        group a row, and the search merges them once its last row is back."""
        rows = step.sched.beam_rows
        if not rows:
            return logits
        searches: dict[str, list[tuple[int, str, BeamRow]]] = {}
        for index, state in enumerate(step.states or ()):
            row = rows.get(state.req_id)
            if row is not None:
                searches.setdefault(row.search_id, []).append((index, state.req_id, row))
        if not searches:
            return logits
        indices: list[int] = []
        scores: list[float] = []
        groups: list[tuple[int, int]] = []
        owners: list[tuple[str, list[int]]] = []
        for members in searches.values():
            whole = len(members) == members[0][2].num_beams
            for part in [members] if whole else [[m] for m in members]:
                indices += [index for index, _, _ in part]
                scores += [row.score for _, _, row in part]
                groups.append((len(part), part[0][2].keep))
                owners.append((part[0][1], [row.beam for _, _, row in part]))
        if indices == list(range(len(indices))):
            beam_logits = logits[: len(indices)]  # (one search alone in the step: no gather)
        else:
            beam_logits = logits[to_device(indices, torch.long, self.device)]
        top = beam_top_k(beam_logits, to_device(scores, torch.float32, self.device), groups)
        self._steps[step] = _BeamStep(top, owners)
        return logits

    def copy_to_host(self, step: InFlightStep) -> None:
        beam = self._steps.get(step)
        if beam is None:
            return
        top = beam.top
        tensors: tuple[torch.Tensor, ...] = (top.scores, top.rows, top.token_ids)
        if self.device.type == "cuda":
            tensors = tuple(t.to("cpu", non_blocking=True) for t in tensors)
        beam.host = tensors

    def finish(self, step: InFlightStep, out: StepOutputs) -> None:
        beam = self._steps.pop(step, None) if self._steps else None
        if beam is None or beam.host is None:
            return
        scores, rows, tokens = (t.tolist() for t in beam.host)
        start = 0
        for (req_id, beams), size in zip(beam.owners, beam.top.sizes):
            end = start + size
            out.beam_candidates[req_id] = BeamCandidates(
                scores[start:end], [beams[r] for r in rows[start:end]], tokens[start:end]
            )
            start = end
