"""A vLLM command line ported to kiln: what kiln can honour is accepted, the rest is refused in
one line naming the flag (never argparse's whole usage), and `kiln serve --version` answers."""

from __future__ import annotations

import argparse
import os

import pytest

from kiln.cli.main import main


def _serve_args(argv: list[str]) -> argparse.Namespace:
    from kiln.cli import serve
    from kiln.cli.parser import OneLineParser

    top = OneLineParser()
    serve.add_parser(top.add_subparsers())
    return top.parse_args(["serve", *argv])


@pytest.mark.parametrize(
    "argv, named",
    [
        (["serve", "--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype fp8_e5m2"),
        (["serve", "--tool-call-parser", "pythonic"], "--tool-call-parser pythonic"),
        (["serve", "--revision", "v2"], "--revision v2"),
        (["serve", "--limit-mm-per-prompt", "image=2"], "--limit-mm-per-prompt image=2"),
        (["serve", "--guided-decoding-backend", "outlines"], "--guided-decoding-backend out"),
        (["serve", "--no-such-flag"], "--no-such-flag"),
        (["bench", "serve", "--endpoint", "/v1/chat/completions"], "--endpoint /v1/chat"),
        (["bench", "serve", "--percentile-metrics", "ttft,goodput"], "--percentile-metrics good"),
        (["bench", "serve", "--dataset-name", "sonnet"], "--dataset-name sonnet"),
        (["bench", "latency", "--batch-size", "8"], "--batch-size 8"),
        (["bench", "throughput", "--swap-space", "4"], "--swap-space 4"),
        (["serve", "--lora-dtype", "float16"], "--lora-dtype float16"),
    ],
)
def test_what_kiln_lacks_is_one_line_naming_the_flag(argv, named, capsys):
    """Exit status 2 and one line on stderr: no usage dump."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"not supported: {named}" in err[0], err


def test_serve_version_answers(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--version"])
    import kiln

    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"kiln {kiln.__version__}"


def test_vllm_serve_flags_kiln_can_honour_are_accepted(tmp_path, monkeypatch, caplog):
    from kiln.cli.vllm_flags import check_vllm_serve_flags

    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    args = _serve_args(["m", "--swap-space", "4", "--download-dir", str(tmp_path),
                        "--guided-decoding-backend", "xgrammar", "--kv-cache-dtype", "fp8",
                        "--enable-auto-tool-choice"])  # fmt: skip
    with caplog.at_level("WARNING"):
        check_vllm_serve_flags(args)
    assert os.environ["HF_HUB_CACHE"] == str(tmp_path)
    assert "--swap-space 4.0 has no effect" in caplog.text  # accepted, not silently


def test_vllm_lora_flags_parse():
    """vLLM's LoRA command line: both --lora-modules spellings, the engine's limits."""
    from kiln.cli.engine_args import engine_config_from_args
    from kiln.cli.serve import serve_options
    from kiln.cli.vllm_flags import check_vllm_serve_flags
    from kiln.server.lora_modules import LoRAModule

    args = _serve_args(["base", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "32",
                        "--max-cpu-loras", "4", "--lora-modules", "sql=/a/sql-lora",
                        '{"name": "chat", "path": "/b/chat", "base_model_name": "llama"}',
                        "--lora-dtype", "auto"])  # fmt: skip
    check_vllm_serve_flags(args)
    config = engine_config_from_args(args)
    assert config.enable_lora and (config.max_loras, config.max_lora_rank) == (2, 32)
    assert config.max_cpu_loras == 4
    assert serve_options(args).lora_modules == (
        LoRAModule("sql", "/a/sql-lora"),
        LoRAModule("chat", "/b/chat", "llama"),
    )
    assert not engine_config_from_args(_serve_args(["base"])).enable_lora
    assert serve_options(_serve_args(["base"])).lora_modules == ()


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--lora-modules", "sql"], "--lora-modules sql: give name=path"),
        (["--lora-modules", "=/a"], "the adapter's name is empty"),
        (["--lora-modules", '{"name": "x"}'], "the adapter's path is empty"),
        (["--lora-modules", '{"name": "x", "path": "/a", "rank": 8}'], "the keys name, path"),
        (["--lora-modules", "{not json"], "not JSON"),
        (["--lora-modules", "a=/x", "a=/y"], "the name 'a' is given twice"),
        (["--lora-modules", "m=/x"], "that is the base model's name"),
        (["--max-loras", "0"], "EngineConfig.max_loras must be >= 1"),
    ],
)
def test_a_wrong_lora_flag_is_one_line(argv, says, capsys):
    assert main(["serve", "m", "--enable-lora", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_lora_modules_need_enable_lora(capsys):
    """Refused before any model loads."""
    assert main(["serve", "no-such-model", "--lora-modules", "a=/x"]) == 2
    assert capsys.readouterr().err.strip() == "error: --lora-modules needs --enable-lora"


def test_vllm_bench_serve_flags_are_accepted():
    from kiln.cli import bench
    from kiln.cli.parser import OneLineParser
    from kiln.cli.vllm_flags import resolve_vllm_bench_flags

    top = OneLineParser()
    bench.add_parser(top.add_subparsers())
    args = top.parse_args(
        ["bench", "serve", "--model", "m", "--host", "localhost", "--port", "8123",
         "--endpoint", "/v1/completions", "--percentile-metrics", "ttft,tpot,itl,e2el",
         "--metric-percentiles", "50,99", "--ignore-eos", "--random-input-len", "100",
         "--random-range-ratio", "0.5", "--burstiness", "0.5"]
    )  # fmt: skip
    resolve_vllm_bench_flags(args)
    assert args.base_url == "http://localhost:8123" and args.model == "m"
    assert args.input_len == "50:150" and args.burstiness == 0.5
    latency = top.parse_args(["bench", "latency", "--num-iters", "4", "--num-iters-warmup", "2",
                              "--batch-size", "1"])  # fmt: skip
    resolve_vllm_bench_flags(latency)
    assert (latency.num_requests, latency.warmup) == (4, 2)
    default = top.parse_args(["bench", "serve"])
    resolve_vllm_bench_flags(default)
    assert default.base_url == "http://127.0.0.1:8000"


def test_burstiness_keeps_the_rate_and_spreads_the_gaps():
    import random
    import statistics

    from kiln.bench.serve_client import Arrivals

    def gaps(burstiness: float) -> list[float]:
        rng = random.Random(0)
        return [Arrivals(10.0, burstiness).gap(rng) for _ in range(20000)]

    poisson, bursty = gaps(1.0), gaps(0.25)
    assert statistics.mean(poisson) == pytest.approx(0.1, rel=0.05)
    assert statistics.mean(bursty) == pytest.approx(0.1, rel=0.05)
    assert statistics.stdev(bursty) > 1.8 * statistics.stdev(poisson)  # cv 2 against 1
