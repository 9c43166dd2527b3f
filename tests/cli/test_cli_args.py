"""The engine flags are generated from EngineConfig's fields, and `kiln` starts without the heavy
dependencies of the verbs it is not running."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import MISSING, fields

import pytest

from kiln.cli.engine_args import (
    add_engine_args,
    engine_config_from_args,
    engine_fields,
    field_docs,
)
from kiln.cli.main import main
from kiln.config import EngineConfig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(p)
    return p


def _flags(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in p._actions for s in a.option_strings}


def test_every_field_has_a_flag_defaulted_and_documented_by_it():
    p, flags = _parser(), _flags(_parser())
    defaults = vars(p.parse_args([]))
    docs = field_docs(EngineConfig)
    assert engine_fields()  # all of them today; metadata={"cli": False} would keep one off
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        assert docs.get(f.name), f"EngineConfig.{f.name} has no docstring"
        if f not in engine_fields():
            assert flag not in flags
            continue
        assert flag in flags and flags[flag].dest == f.name
        assert f.default is not MISSING and defaults[f.name] == f.default, f.name
        # The field's choices, then (for dtype) vLLM's aliases of them.
        choices = f.metadata.get("choices")
        assert flags[flag].choices == choices or flags[flag].choices[: len(choices)] == choices
    assert engine_config_from_args(p.parse_args([])) == EngineConfig()


def test_the_flags_kiln_shipped_with_still_parse():
    args = _parser().parse_args(
        ["--model", "m", "--load-format", "dummy", "--dtype", "float16", "--device", "cuda:1",
         "--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
         "--block-size", "8", "--kv-cache-dtype", "fp8", "--kv-cache-memory-gb", "0.5",
         "--gpu-memory-utilization", "0.5", "--no-prefix-caching", "--scheduling-policy",
         "priority", "--attention-backend", "torch", "--enforce-eager", "--no-async-scheduling",
         "--gc-gen0-threshold", "0", "--seed", "7"]
    )  # fmt: skip
    assert engine_config_from_args(args) == EngineConfig(
        model="m", load_format="dummy", dtype="float16", device="cuda:1", max_model_len=512,
        max_num_seqs=4, max_num_batched_tokens=64, block_size=8, kv_cache_dtype="fp8",
        kv_cache_memory_gb=0.5, gpu_memory_utilization=0.5, enable_prefix_caching=False,
        scheduling_policy="priority", attention_backend="torch", enforce_eager=True,
        async_scheduling=False, gc_gen0_threshold=0, seed=7,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], True),
        (["--no-prefix-caching"], False),
        (["--no-enable-prefix-caching"], False),
        (["--enable-prefix-caching"], True),
    ],
)
def test_prefix_caching_flags(argv, expected):
    assert engine_config_from_args(_parser().parse_args(argv)).enable_prefix_caching is expected


def test_async_scheduling_defaults_to_none_and_takes_both_spellings():
    p = _parser()
    assert p.parse_args([]).async_scheduling is None
    assert p.parse_args(["--async-scheduling"]).async_scheduling is True
    assert p.parse_args(["--no-async-scheduling"]).async_scheduling is False


def test_an_invalid_choice_is_rejected_by_argparse_and_by_the_config():
    with pytest.raises(argparse.ArgumentError, match="kv-cache-dtype"):
        _parser().parse_args(["--kv-cache-dtype", "int4"])
    with pytest.raises(argparse.ArgumentError, match="max-num-seqs"):
        _parser().parse_args(["--max-num-seqs", "many"])
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="cudnn")
    with pytest.raises(SystemExit) as exc:
        main(["generate", "hi", "--kv-cache-dtype", "int4"])
    assert exc.value.code == 2


def test_kiln_help_builds_every_verb(capsys):
    for argv in ([], ["generate"], ["serve"], ["bench"]):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--help"])
        assert exc.value.code == 0
    assert "--max-num-seqs" in capsys.readouterr().out


def test_the_cli_imports_no_heavy_dependency():
    """`kiln --help` stays quick, and bench/generate run where fastapi is not installed: the verb
    modules import torch, transformers, fastapi and uvicorn inside their run functions."""
    code = (
        "import sys\n"
        "import kiln\n"
        "from kiln import EngineConfig, SamplingParams\n"
        "from kiln.cli.main import main\n"
        "for verb in ([], ['generate'], ['serve'], ['bench']):\n"
        "    try:\n"
        "        main([*verb, '--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = ('fastapi', 'uvicorn', 'torch', 'transformers', 'numpy', 'triton', 'gguf')\n"
        "print(sorted(m for m in heavy if m in sys.modules), file=sys.stderr)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "[]"


# ---- vLLM's spellings -------------------------------------------------------------------------


def _serve_args(argv: list[str]) -> argparse.Namespace:
    from kiln.cli import serve

    top = argparse.ArgumentParser()
    serve.add_parser(top.add_subparsers())
    return top.parse_args(["serve", *argv])


def test_vllm_engine_flags_alias_what_kiln_has():
    args = _parser().parse_args(
        ["--dtype", "half", "-tp", "1", "--enable-chunked-prefill", "--trust-remote-code"]
    )
    assert engine_config_from_args(args).dtype == "float16"
    assert engine_config_from_args(_parser().parse_args(["--dtype", "float"])).dtype == "float32"
    parallel = engine_config_from_args(_parser().parse_args(["-tp", "2", "-pp", "3"]))
    assert (parallel.tensor_parallel_size, parallel.pipeline_parallel_size) == (2, 3)
    long = ["--tensor-parallel-size", "4", "--pipeline-parallel-size", "2"]
    parallel = engine_config_from_args(_parser().parse_args(long))
    assert (parallel.tensor_parallel_size, parallel.pipeline_parallel_size) == (4, 2)
    ep = engine_config_from_args(_parser().parse_args(["-tp", "2", "--enable-expert-parallel"]))
    assert ep.enable_expert_parallel and not parallel.enable_expert_parallel


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill"),
        (["--tokenizer", "other/dir"], "--tokenizer other/dir"),
    ],
)
def test_what_kiln_lacks_is_refused_by_name(argv, named, capsys):
    """Never accepted and ignored: the verb exits 2 with "not supported: <the flag>"."""
    assert main(["generate", *argv, "hi"]) == 2
    assert f"not supported: {named}" in capsys.readouterr().err


def test_serve_takes_the_model_positionally_and_vllm_log_flags():
    from kiln.cli.vllm_flags import UnsupportedFlagError, check_vllm_serve_flags

    args = _serve_args(["some/model", "--disable-log-requests", "--uvicorn-log-level", "debug"])
    check_vllm_serve_flags(args)
    assert args.model == "some/model" and not args.enable_log_requests
    assert args.log_level == "debug"
    assert not _serve_args([]).enable_log_requests  # access log off by default
    assert _serve_args(["--enable-log-requests"]).enable_log_requests
    for argv in (["m", "--model", "n"], ["--max-logprobs", "5"], ["--chat-template", "t.jinja"]):
        with pytest.raises(UnsupportedFlagError):
            check_vllm_serve_flags(_serve_args(argv))


def test_version(capsys):
    import kiln

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert (
        exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"kiln {kiln.__version__}"
    )


def test_threads_flag_sets_torchs_intra_op_threads(tmp_path):
    import torch

    from kiln import LLM
    from tests.conftest import build_tiny_hf_model

    build_tiny_hf_model("llama-gqa", str(tmp_path))

    assert engine_config_from_args(_parser().parse_args(["--threads", "1"])).num_threads == 1
    before = torch.get_num_threads()
    try:
        LLM(str(tmp_path), num_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_kiln_builds_quantization_choices_are_the_builders() -> None:
    from kiln.builder.options import CHECKPOINT_SCHEMES, KV_CACHE_DTYPES, QUANTIZATIONS
    from kiln.cli.build import _CHECKPOINT_SCHEMES, _KV_CACHE_DTYPES, _QUANTIZATIONS

    assert _QUANTIZATIONS == QUANTIZATIONS
    assert _KV_CACHE_DTYPES == KV_CACHE_DTYPES
    assert _CHECKPOINT_SCHEMES.pattern == CHECKPOINT_SCHEMES.pattern
