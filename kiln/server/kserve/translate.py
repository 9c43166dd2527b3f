"""The two models' tensors <-> engine requests and outputs.

Inputs arrive validated against the model's declared names, datatypes and shapes (core.py); here
each batch row becomes one engine request with its own SamplingParams, and each response's
output tensors are built from what the rows have generated.

Sampling follows TensorRT-LLM's rule (its sampling docs): no temperature, top_k or top_p given,
or temperature 0, top_p 0 or top_k 1, is greedy; otherwise it samples, the missing ones
defaulting to temperature 1, top_k 0 (all), top_p 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from kiln.errors import InvalidRequestError
from kiln.outputs import CompletionOutput
from kiln.sampling_params import SamplingParams
from kiln.server.generation import EngineRequest
from kiln.server.kserve.errors import invalid
from kiln.server.kserve.models import ENSEMBLE, TENSORRT_LLM, ModelSpec
from kiln.server.params import check_max_tokens
from kiln.server.state import ServerState

# A model's input names for kiln's sampling fields (errors name the tensor the client sent).
_TRTLLM_NAMES = {
    "max_tokens": "request_output_len",
    "temperature": "temperature",
    "top_k": "runtime_top_k",
    "top_p": "runtime_top_p",
    "min_tokens": "min_tokens",
    "seed": "seed",
    "stop_token_ids": "end_id",
}
_ENSEMBLE_NAMES = {**_TRTLLM_NAMES, "max_tokens": "max_tokens", "top_k": "top_k", "top_p": "top_p"}
_SHARED = ("repetition_penalty", "presence_penalty", "frequency_penalty")
T = TypeVar("T")


@dataclass
class Row:
    """One batch row: its engine request and what it has generated so far."""

    prompt_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    exclude_input: bool
    ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    # Since the last streamed response.
    new_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    def advance(self, out: CompletionOutput) -> None:
        self.ids += out.token_ids
        self.new_ids += out.token_ids
        self.text += out.text
        self.new_text += out.text
        if out.logprobs:
            lps = [pos[t].logprob for t, pos in zip(out.token_ids, out.logprobs)]
            self.logprobs += lps
            self.new_logprobs += lps
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason

    def take_new(self) -> None:
        self.new_ids, self.new_text, self.new_logprobs = [], "", []


@dataclass
class Plan:
    rows: list[Row]
    requests: list[EngineRequest]
    streaming: bool
    pad_id: int
    outputs: tuple[str, ...]  # the output tensors to return


def plan(
    spec: ModelSpec,
    inputs: dict[str, np.ndarray],
    outputs: tuple[str, ...] | None,
    state: ServerState,
    req_id: str,
) -> Plan:
    """Engine requests for validated inputs (batch dimension first)."""
    batch = len(next(iter(inputs.values())))
    wanted = outputs or spec.default_outputs
    rows = []
    for b in range(batch):
        get = lambda name, b=b: _scalar(inputs, name, b)
        want_logprobs = bool(get("return_log_probs")) or any(
            name in ("cum_log_probs", "output_log_probs") for name in outputs or ()
        )
        if want_logprobs and not outputs:
            wanted = (*spec.default_outputs, "cum_log_probs", "output_log_probs")
        if spec is TENSORRT_LLM:
            prompt_ids, prompt_text = _token_prompt(inputs, b, state), None
            stop_ids = _stop_words_list(inputs, b, state)
            _refuse_words_list(inputs, b, "bad_words_list")
            names = _TRTLLM_NAMES
            max_tokens = get("request_output_len")
            stop: list[str] = []
        else:
            prompt_text = _text(inputs["text_input"][b, 0], "text_input")
            prompt_ids = state.tokenize(prompt_text)
            stop_ids = []
            stop = _words(inputs, b, "stop_words")
            if _words(inputs, b, "bad_words"):
                raise invalid(
                    "input 'bad_words' is not supported: kiln has no banned-words sampling"
                )
            names = _ENSEMBLE_NAMES
            max_tokens = get("max_tokens")
        try:  # as the OpenAI routes: a max_tokens past the context is an error, not a cap
            check_max_tokens(max_tokens, [len(prompt_ids)], state.max_model_len)
        except InvalidRequestError as exc:
            raise invalid(f"input '{names['max_tokens']}': {exc}") from None
        if (get("beam_width") or 1) != 1:
            raise invalid(
                "input 'beam_width': only 1 is supported over KServe v2 (kiln's beam search is "
                "on the OpenAI routes: use_beam_search with n / best_of)"
            )
        params = _sampling_params(
            get, names, spec, max_tokens, stop, stop_ids, want_logprobs, state
        )
        exclude = get("exclude_input_in_output")
        rows.append(
            Row(
                prompt_ids,
                prompt_text,
                params,
                spec.exclude_input_in_output if exclude is None else bool(exclude),
            )
        )
    stream_name = "streaming" if spec is TENSORRT_LLM else "stream"
    streaming = {bool(_scalar(inputs, stream_name, b)) for b in range(batch)}
    if len(streaming) > 1:
        raise invalid(f"input '{stream_name}' must be the same for every row of the batch")
    pad_id = _scalar(inputs, "pad_id", 0)
    end_id = _scalar(inputs, "end_id", 0)
    requests = [EngineRequest(f"{req_id}-{b}", r.prompt_ids, r.params) for b, r in enumerate(rows)]
    return Plan(
        rows,
        requests,
        streaming.pop(),
        pad_id if pad_id is not None else (end_id if end_id is not None else 0),
        tuple(dict.fromkeys(wanted)),
    )


def output_tensors(
    spec: ModelSpec, plan: Plan, streamed: bool
) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (datatype, array) for the plan's outputs: the new part of each row when
    `streamed`, else all of it. Rows of different lengths are padded with pad_id (0.0 for
    log-probabilities); shapes are [batch, beam=1, ...] as the backend's."""
    rows = plan.rows
    tensors: dict[str, tuple[str, np.ndarray]] = {}
    for name in plan.outputs:
        if name == "output_ids":
            ids = [r.new_ids if streamed else _full_ids(r) for r in rows]
            tensors[name] = ("INT32", _padded(ids, plan.pad_id, np.int32))
        elif name == "sequence_length":
            ids = [r.new_ids if streamed else _full_ids(r) for r in rows]
            tensors[name] = ("INT32", np.array([[len(s)] for s in ids], dtype=np.int32))
        elif name == "cum_log_probs":
            # Cumulative over everything generated so far, streamed or not (as the backend).
            cum = [[float(np.sum(r.logprobs, dtype=np.float64))] for r in rows]
            tensors[name] = ("FP32", np.array(cum, dtype=np.float32))
        elif name == "output_log_probs":
            logprobs = [r.new_logprobs if streamed else r.logprobs for r in rows]
            tensors[name] = ("FP32", _padded(logprobs, 0.0, np.float32))
        elif name == "text_output":
            texts = [r.new_text if streamed else _full_text(r) for r in rows]
            arr = np.empty((len(rows), 1), dtype=object)
            arr[:, 0] = [t.encode() for t in texts]
            tensors[name] = ("BYTES", arr)
    return tensors


# ---- helpers -------------------------------------------------------------------------------


def _scalar(inputs: dict[str, np.ndarray], name: str, b: int) -> Any:
    """Row b's value of a [batch, 1] input, as a Python scalar (an int, float or bool: the
    input's declared datatype, which core.py checked); None if not given."""
    arr = inputs.get(name)
    if arr is None:
        return None
    return arr[b].reshape(-1)[0].item()


def _text(value: bytes, name: str) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(f"input '{name}' is not valid UTF-8: {exc}") from None


def _words(inputs: dict[str, np.ndarray], b: int, name: str) -> list[str]:
    arr = inputs.get(name)
    if arr is None:
        return []
    return [w for w in (_text(v, name) for v in arr[b].reshape(-1)) if w]


def _token_prompt(inputs: dict[str, np.ndarray], b: int, state: ServerState) -> list[int]:
    row = inputs["input_ids"][b]
    length = _scalar(inputs, "input_lengths", b)
    if not 1 <= length <= len(row):
        raise invalid(
            f"input 'input_lengths': {length} for row {b}, whose input_ids hold {len(row)} tokens"
        )
    ids = row[:length].tolist()
    bad = next((t for t in ids if not 0 <= t < state.vocab_size), None)
    if bad is not None:
        raise invalid(f"input 'input_ids': token id {bad} is outside [0, {state.vocab_size})")
    return ids


def _word_ids(inputs: dict[str, np.ndarray], b: int, name: str) -> list[list[int]]:
    """TensorRT-LLM's words list, [2, n] per row: the words' ids concatenated, then each word's
    end offset, -1 padded."""
    arr = inputs.get(name)
    if arr is None:
        return []
    ids, offsets = arr[b][0].tolist(), arr[b][1].tolist()
    words, start = [], 0
    for end in offsets:
        if end < 0:
            break
        if not start <= end <= len(ids):
            raise invalid(f"input '{name}': offset {end} out of order or past the ids in row {b}")
        if end > start:
            words.append(ids[start:end])
        start = end
    return words


def _refuse_words_list(inputs: dict[str, np.ndarray], b: int, name: str) -> None:
    if _word_ids(inputs, b, name):
        raise invalid(f"input '{name}' is not supported: kiln has no banned-words sampling")


def _stop_words_list(inputs: dict[str, np.ndarray], b: int, state: ServerState) -> list[int]:
    stop_ids = []
    for word in _word_ids(inputs, b, "stop_words_list"):
        if len(word) > 1:
            raise invalid(
                "input 'stop_words_list': multi-token stop words are not supported (kiln stops "
                "on single token ids; the ensemble model's stop_words take text)"
            )
        if not 0 <= word[0] < state.vocab_size:
            raise invalid(
                f"input 'stop_words_list': token id {word[0]} is outside [0, {state.vocab_size})"
            )
        stop_ids.append(word[0])
    return stop_ids


def _sampling_params(
    get: Callable[[str], Any],
    names: dict[str, str],
    spec: ModelSpec,
    max_tokens: int | None,
    stop: list[str],
    stop_ids: list[int],
    want_logprobs: bool,
    state: ServerState,
) -> SamplingParams:
    temperature, top_k, top_p = get("temperature"), get(names["top_k"]), get(names["top_p"])
    if top_k is not None and top_k < 0:
        raise invalid(f"input '{names['top_k']}' must be >= 0, got {top_k}")
    if top_p is not None and not 0.0 <= top_p <= 1.0:
        raise invalid(f"input '{names['top_p']}' must be in [0, 1], got {top_p}")
    greedy = (temperature, top_k, top_p) == (None, None, None) or (
        temperature == 0 or top_p == 0 or top_k == 1
    )
    end_id = get("end_id")
    ignore_eos = end_id is not None  # end_id replaces the model's EOS; -1 never stops
    if end_id is not None and end_id != -1:
        if not 0 <= end_id < state.vocab_size:
            raise invalid(f"input 'end_id': {end_id} is outside [-1, {state.vocab_size})")
        stop_ids = [*stop_ids, end_id]
    seed, random_seed = get("seed"), get("random_seed")
    if seed is not None and random_seed is not None and seed != random_seed:
        raise invalid("inputs 'seed' and 'random_seed' are the same field: give one")
    min_tokens, min_length = get("min_tokens"), get("min_length")
    if min_tokens is not None and min_length is not None and min_tokens != min_length:
        raise invalid("inputs 'min_tokens' and 'min_length' are the same field: give one")
    try:
        return SamplingParams(
            temperature=0.0 if greedy else (1.0 if temperature is None else temperature),
            top_k=0 if greedy or top_k is None else top_k,
            top_p=1.0 if greedy or top_p is None else top_p,
            repetition_penalty=_or(get("repetition_penalty"), 1.0),
            presence_penalty=_or(get("presence_penalty"), 0.0),
            frequency_penalty=_or(get("frequency_penalty"), 0.0),
            seed=_or(seed, random_seed),
            max_tokens=max_tokens,
            min_tokens=_or(_or(min_tokens, min_length), 0),
            stop=stop,
            stop_token_ids=stop_ids,
            ignore_eos=ignore_eos,
            logprobs=0 if want_logprobs else None,
        )
    except InvalidRequestError as exc:
        tensor = names.get(exc.param or "", exc.param if exc.param in _SHARED else None)
        raise invalid(f"input '{tensor or exc.param}': {exc}") from None


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


def _full_ids(row: Row) -> list[int]:
    return row.ids if row.exclude_input else row.prompt_ids + row.ids


def _full_text(row: Row) -> str:
    return row.text if row.exclude_input else (row.prompt_text or "") + row.text


def _padded(seqs: Sequence[Sequence[float]], pad: float, dtype: type) -> np.ndarray:
    width = max((len(s) for s in seqs), default=0)
    arr: np.ndarray = np.full((len(seqs), 1, width), pad, dtype=dtype)
    for i, s in enumerate(seqs):
        arr[i, 0, : len(s)] = s
    return arr


__all__ = ["ENSEMBLE", "TENSORRT_LLM", "Plan", "Row", "output_tensors", "plan"]
