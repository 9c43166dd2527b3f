"""The offline Python API: `LLM(...).generate(...)`, `.chat(...)`, `.stream(...)`."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kiln.checkpoint import prehash
from kiln.config import EngineConfig
from kiln.errors import InvalidRequestError
from kiln.lora.request import LoRARequest
from kiln.outputs import RequestOutput
from kiln.sampling_params import SamplingParams
from kiln.tokenizer import Tokenizer

if TYPE_CHECKING:
    from typing_extensions import TypeIs

# vLLM's prompt forms: text, token ids, or {"prompt": text} / {"prompt_token_ids": ids}.
Prompt = str | list[int] | dict[str, Any]
Message = dict[str, str]
# One adapter for every prompt, or one per prompt (None: the base model).
LoRARequests = LoRARequest | Sequence[LoRARequest | None] | None


class LLM:
    """An engine in this process. `LLM()` loads the embedded SmolLM2-135M-Instruct;
    `LLM("path/to/hf-dir")`, `LLM("model.gguf")` or `LLM("llama-3.1-8b", load_format="dummy")`
    load others. Keyword arguments are `EngineConfig` fields (max_num_seqs, block_size, ...)."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        unknown = set(engine_args) - EngineConfig.field_names()
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}")
        self.config = EngineConfig(model=model, **engine_args)
        # An engine directory's weights hash in a child process while the engine's imports
        # (torch and its CUDA libraries: ~4 s of a cold start on the H200 host) run here, so
        # the loader only reads and copies them (kiln.checkpoint.prehash). This module imports
        # no torch for that reason: `from kiln import LLM` is cheap, the import happens below.
        start = time.perf_counter()
        queued = 0
        directory = self._prehash_dir()
        if directory is not None and prehash.worth_it():
            queued = prehash.start(directory)
        try:
            from kiln.engine.llm_engine import LLMEngine

            imported = time.perf_counter()
            self.engine = LLMEngine(self.config)
        finally:
            prehash.discard()  # whatever the load did not take
        # Where a start's time goes: the engine's imports
        # (torch's, in a fresh process), and how many shards were hashed beside them.
        self.startup = {"engine_import_s": imported - start, "prehash_shards": queued}

    def _prehash_dir(self) -> str | None:
        """The engine directory to prehash: one loaded by this process alone (under TP/PP each
        rank reads its own shards in its own process); None otherwise."""
        c = self.config
        if (
            c.model is None
            or c.load_format != "auto"
            or c.tensor_parallel_size != 1
            or c.pipeline_parallel_size != 1
        ):
            return None
        directory = os.path.expanduser(c.model)
        return directory if os.path.isfile(os.path.join(directory, prehash.MANIFEST_FILE)) else None

    def shutdown(self) -> None:
        """Stop the engine's rank processes (tensor/pipeline parallel); a no-op otherwise."""
        self.engine.shutdown()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def _chat_tokenizer(self) -> Tokenizer:
        tokenizer = self.get_tokenizer()
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template", param="messages")
        return tokenizer

    def apply_chat_template(
        self, messages: list[Message], add_generation_prompt: bool = True
    ) -> str:
        try:
            return self._chat_tokenizer().apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except InvalidRequestError:
            raise
        except Exception as exc:  # a template may refuse a conversation, or the sandbox it
            reason = " ".join(str(exc).split())  # one line, as the CLI prints it
            raise InvalidRequestError(
                f"the chat template failed: {reason}", param="messages"
            ) from exc

    def _chat_prompt_ids(self, messages: list[Message]) -> list[int]:
        # The template already holds any BOS token: encode without adding special tokens again.
        text = self.apply_chat_template(messages)
        return self._chat_tokenizer().encode(text, add_special_tokens=False)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequests = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); returns outputs in prompt order.
        `lora_request`: the LoRA adapter (an engine with enable_lora=True) of every prompt, or
        a list with one per prompt (None: the base model)."""
        if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
            prompts = [prompts]
        plain = [_plain_prompt(p) for p in prompts]
        texts = [p if isinstance(p, str) else None for p in plain]
        token_ids = [p if not isinstance(p, str) else None for p in plain]
        return self._run(texts, token_ids, sampling_params, use_tqdm, priority, lora_request)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        lora_request: LoRARequests = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate
        (`lora_request` as generate's)."""
        conversations = [messages] if _is_conversation(messages) else messages
        prompt_ids = [self._chat_prompt_ids(c) for c in conversations]
        texts = [self._chat_tokenizer().decode(ids) for ids in prompt_ids]
        return self._run(texts, prompt_ids, sampling_params, use_tqdm, None, lora_request)

    def stream(
        self,
        prompt: Prompt | list[Message],
        sampling_params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Iterator[str]:
        """Yield the text of one completion piece by piece as it is generated (a list of chat
        messages gets the chat template; `lora_request` as generate's)."""
        plain = self._chat_prompt_ids(prompt) if _is_conversation(prompt) else _plain_prompt(prompt)
        req_id = self.engine.add_request(plain, sampling_params, lora_request=lora_request)
        try:
            finished = False
            while not finished:
                for delta in self.engine.step():
                    if delta.request_id != req_id:
                        continue
                    for completion in delta.outputs:
                        if completion.text:
                            yield completion.text
                    finished = delta.finished
            self.engine.finished_output(req_id)
        finally:
            self.engine.abort_request(req_id)  # a consumer that stops early frees the blocks

    def _run(
        self,
        texts: Sequence[str | None],
        token_ids: Sequence[list[int] | None],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        priority: Sequence[int] | None,
        lora_request: LoRARequests = None,
    ) -> list[RequestOutput]:
        n = len(texts)
        loras: list[LoRARequest | None]
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * n
        else:
            loras = list(lora_request)
            if len(loras) != n:
                raise InvalidRequestError(
                    f"got {len(loras)} LoRA requests for {n} prompts", "lora_request"
                )
        params_list: list[SamplingParams | None]
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != n:
                raise InvalidRequestError(
                    f"got {len(sampling_params)} sampling params for {n} prompts",
                    "sampling_params",
                )
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params] * n
        if priority is not None and len(priority) != n:
            raise InvalidRequestError(f"got {len(priority)} priorities for {n} prompts", "priority")
        req_ids: list[str] = []
        try:  # all or nothing: one invalid prompt queues none of them
            for i in range(n):
                prompt = token_ids[i] if token_ids[i] is not None else texts[i]
                req_ids.append(
                    self.engine.add_request(
                        prompt,
                        params_list[i],
                        priority=priority[i] if priority else 0,
                        lora_request=loras[i],
                    )
                )
                state = self.engine.output_processor.requests.get(req_ids[-1])
                if texts[i] is not None and state is not None:  # (a beam search has none)
                    state.prompt = texts[i]
        except Exception:
            self.engine.abort_request(req_ids)
            raise
        results: dict[str, RequestOutput] = {}
        pending = set(req_ids)
        from tqdm.auto import tqdm  # here, not at import: ~50-75 ms of every cold start

        with tqdm(total=n, desc="generating", disable=not use_tqdm) as bar:
            while pending:
                for delta in self.engine.step():
                    if delta.finished and delta.request_id in pending:
                        output = self.engine.finished_output(delta.request_id)
                        assert output is not None  # finished just now: its output is there
                        results[delta.request_id] = output
                        pending.discard(delta.request_id)
                        bar.update(1)
        return [results[r] for r in req_ids]


def _is_token_ids(value: object) -> TypeIs[list[int]]:
    """One prompt of token ids (not a list of prompts)."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], int)


def _is_conversation(value: object) -> TypeIs[list[Message]]:
    """One conversation (chat messages), not a list of them."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict)


def _plain_prompt(prompt: Prompt) -> str | list[int]:
    """A dict prompt (vLLM's TextPrompt / TokensPrompt) as its text or token ids."""
    if not isinstance(prompt, dict):
        return prompt
    keys = set(prompt)
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if keys == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], list):
        return prompt["prompt_token_ids"]
    raise InvalidRequestError(
        "a dict prompt must be {'prompt': str} or {'prompt_token_ids': list[int]}, "
        f"got keys {sorted(keys)}"
    )
