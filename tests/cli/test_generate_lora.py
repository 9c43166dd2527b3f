"""`kiln generate --lora PATH`: the adapter's tokens, and a bad adapter's one-line error."""

from __future__ import annotations

import json

from kiln import LLM, LoRARequest, SamplingParams
from kiln.cli.main import main
from tests.lora.adapters import ALL_SEVEN, AdapterSpec, build_adapter
from tests.tiny_tokenizer import build_tiny_chat_model


def test_generate_with_an_adapter(tmp_path, capsys):
    import transformers

    build_tiny_chat_model(str(tmp_path / "base"))  # (a tokenizer: the CLI takes text)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"))
    build_adapter(base, AdapterSpec("a", 4, 8, ALL_SEVEN), str(tmp_path / "a"), seed=1)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\nabc\n")
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(tmp_path / "base"), "--max-tokens", "6", "--ignore-eos"]
    argv += ["--no-chat", "--prompts-file", str(prompts), "-o", str(out)]
    assert main([*argv, "--lora", str(tmp_path / "a")]) == 0
    got = _token_ids(out)
    assert main(argv) == 0
    base_got = _token_ids(out)
    llm = LLM(str(tmp_path / "base"), enable_lora=True)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    lora = LoRARequest("a", 1, str(tmp_path / "a"))
    expected = llm.generate(["hello there", "abc"], params, lora_request=lora)
    assert got == [o.outputs[0].token_ids for o in expected] != base_got

    capsys.readouterr()
    assert main([*argv, "--lora", str(tmp_path / "nowhere")]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]  # (after the start-up lines)
    assert error.startswith("error: LoRA adapter 'nowhere'") and "no such directory" in error


def _token_ids(jsonl) -> list[list[int]]:
    return [json.loads(line)["outputs"][0]["token_ids"] for line in jsonl.read_text().splitlines()]
