"""Request body -> SamplingParams, with the checks that need the model (its vocabulary) and the
refusals of OpenAI features kiln does not implement (a clear 400 rather than silent ignoring)."""

from __future__ import annotations

from typing import TypeVar

from kiln.errors import InvalidRequestError
from kiln.sampling_params import SamplingParams
from kiln.server.protocol import SamplingFields
from kiln.server.structured_output import guided_decoding_params

T = TypeVar("T")


def _pick(value: T | None, default: T) -> T:
    return default if value is None else value


def refuse_unsupported(req: SamplingFields) -> None:
    if req.logit_bias:
        raise InvalidRequestError("logit_bias is not supported", param="logit_bias")


def check_max_tokens(max_tokens: int | None, prompt_lens: list[int], max_model_len: int) -> None:
    """A max_tokens that does not fit beside the prompt is a 400, as vLLM answers, not a silent
    cap (the client would read 'length' and think it got what it asked for)."""
    if max_tokens is None or not prompt_lens:
        return
    longest = max(prompt_lens)
    if longest >= max_model_len:
        return  # the prompt alone is too long: the engine says so (param "prompt")
    if longest + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} in "
            "the completion). Please reduce the length of the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )


def build_sampling_params(
    req: SamplingFields,
    defaults: SamplingParams,
    vocab_size: int,
    *,
    max_tokens: int | None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """SamplingParams for one request; fields the client left out take the model's defaults.
    SamplingParams validates the rest and names the field (-> 400 with `param`)."""
    refuse_unsupported(req)
    stop_token_ids = list(req.stop_token_ids or [])
    # Out-of-vocabulary ids would index past the logits when masked under min_tokens.
    bad = [t for t in stop_token_ids if t >= vocab_size]
    if bad:
        raise InvalidRequestError(
            f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})",
            param="stop_token_ids",
        )
    stop = req.stop if req.stop is not None else []
    return SamplingParams(
        n=_pick(req.n, 1),
        temperature=_pick(req.temperature, defaults.temperature),
        top_p=_pick(req.top_p, defaults.top_p),
        top_k=_pick(req.top_k, defaults.top_k),
        min_p=_pick(req.min_p, defaults.min_p),
        repetition_penalty=_pick(req.repetition_penalty, defaults.repetition_penalty),
        presence_penalty=_pick(req.presence_penalty, 0.0),
        frequency_penalty=_pick(req.frequency_penalty, 0.0),
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=_pick(req.min_tokens, 0),
        stop=[stop] if isinstance(stop, str) else list(stop),
        stop_token_ids=stop_token_ids,
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=_pick(req.skip_special_tokens, True),
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        guided_decoding=guided_decoding_params(req),
        use_beam_search=bool(req.use_beam_search),
        best_of=getattr(req, "best_of", None) if req.use_beam_search else None,
        length_penalty=_pick(req.length_penalty, 1.0),
        early_stopping=False if req.early_stopping is None else req.early_stopping,
    )
