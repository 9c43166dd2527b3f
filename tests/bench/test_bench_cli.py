"""`kiln bench`'s command line: a sub-command per mode with its own --help, vLLM's benchmark flag
names, and `kiln bench sweep`'s table, JSON and plot on a tiny model."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from kiln.cli import bench
from kiln.cli.main import main
from tests.conftest import build_tiny_hf_model


def _parse(argv: list[str]) -> argparse.Namespace:
    top = argparse.ArgumentParser()
    bench.add_parser(top.add_subparsers())
    return top.parse_args(["bench", *argv])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny")
    build_tiny_hf_model("llama-gqa", str(path))
    return str(path)


def test_each_mode_has_its_own_help(capsys):
    helps = {}
    for mode in ("throughput", "latency", "serve", "sweep"):
        with pytest.raises(SystemExit) as exc:
            main(["bench", mode, "--help"])
        assert exc.value.code == 0
        helps[mode] = capsys.readouterr().out
    assert "--base-url" in helps["serve"] and "--baseline" not in helps["serve"]
    assert "--max-num-seqs" not in helps["serve"]  # no local engine in serve mode
    assert "--baseline" in helps["throughput"] and "--base-url" not in helps["throughput"]
    assert "--max-num-seqs" in helps["latency"] and "comma-separated" in helps["sweep"]


def test_vllm_benchmark_names_set_kilns_fields():
    vllm = _parse(["throughput", "--num-prompts", "5", "--max-concurrency", "2",
                   "--random-input-len", "8", "--random-output-len", "4",
                   "--dataset-name", "random"])  # fmt: skip
    kiln = _parse(["throughput", "--num-requests", "5", "--concurrency", "2",
                   "--input-len", "8", "--output-len", "4"])  # fmt: skip
    assert vars(vllm) == vars(kiln)
    assert vllm.num_requests == 5 and vllm.concurrency == 2 and vllm.input_len == "8"
    serve = _parse(["serve", "--num-prompts", "3", "--max-concurrency", "4"])
    assert (serve.num_requests, serve.concurrency) == (3, 4)


def test_other_datasets_and_orphan_result_flags_are_refused(capsys):
    assert main(["bench", "serve", "--dataset-name", "sharegpt"]) == 2
    assert "--dataset-name sharegpt and --dataset-path go together" in capsys.readouterr().err
    assert main(["bench", "serve", "--result-dir", "x"]) == 2
    assert "need --save-result" in capsys.readouterr().err


def test_save_result_writes_to_result_dir(tiny_dir, tmp_path):
    argv = ["bench", "latency", "--model", tiny_dir, "--num-prompts", "1",
            "--random-input-len", "8", "--random-output-len", "3", "--no-progress",
            "--save-result", "--result-dir", str(tmp_path / "out"),
            "--result-filename", "lat.json"]  # fmt: skip
    assert main(argv) == 0
    record = json.loads((tmp_path / "out" / "lat.json").read_text())
    assert record["workload"]["num_requests"] == 1 and record["kiln"]["output_tokens"] == 3


def test_sweep_writes_table_json_and_plot(tiny_dir, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    argv = ["bench", "sweep", "--model", tiny_dir, "--concurrency", "1,4", "--num-requests", "4",
            "--input-len", "4:12", "--output-len", "3:6", "--no-progress",
            "--output-json", str(out)]  # fmt: skip
    assert main(argv) == 0
    record = json.loads(out.read_text())
    levels = [p["concurrency"] for p in record["points"]]
    assert levels == [1, 4] and record["workload"]["levels"] == [1, 4]
    for point in record["points"]:
        assert point["num_requests"] == 4 and point["output_tok_s"] > 0
        assert point["tpot"]["p50_ms"] > 0 and point["ttft"]["p99_ms"] > 0
    assert record["env"]["git_revision"]
    table = capsys.readouterr().out
    assert "TPOT p50" in table and "\n" + " " * 3 + "4" in table
    png = tmp_path / "sweep.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_without_matplotlib_says_how_to_get_it(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = tmp_path / "s.json"
    argv = ["bench", "sweep", "--model", tiny_dir, "--concurrency", "2", "--num-requests", "2",
            "--input-len", "4", "--output-len", "2", "--no-progress", "--warmup", "0",
            "--output-json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "pip install 'kiln[plot]'" in capsys.readouterr().out
    assert out.exists() and not (tmp_path / "s.png").exists()


def test_sweep_levels_must_be_positive_integers(capsys):
    assert main(["bench", "sweep", "--base-url", "http://127.0.0.1:9", "--concurrency", "1,x"]) == 2
    assert "positive integers" in capsys.readouterr().err


def test_output_json_into_a_missing_folder_is_made_before_the_run(tiny_dir, tmp_path, capsys):
    """The folder is made before the benchmark runs (it used to crash after it, losing it); the
    table has no empty hf columns without a baseline."""
    out = tmp_path / "new" / "deeper" / "t.json"
    argv = ["bench", "throughput", "--model", tiny_dir, "--num-prompts", "2", "--input-len", "4",
            "--output-len", "2", "--no-progress", "--warmup", "0",
            "--output-json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(out.read_text())["kiln"]["output_tokens"] == 4
    header = next(line for line in capsys.readouterr().out.splitlines() if "metric" in line)
    assert header.split() == ["metric", "kiln"]


def test_an_unwritable_output_is_refused_before_anything_loads(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    argv = ["bench", "latency", "--model", "/no/such/model", "--output-json",
            str(blocker / "x.json")]  # fmt: skip
    assert main(argv) == 2  # before the (missing) model is looked at
    assert "--output-json" in capsys.readouterr().err
    assert main(["bench", "sweep", "--base-url", "http://127.0.0.1:9", "--output-json",
                 str(tmp_path)]) == 2  # fmt: skip
    assert "is a folder" in capsys.readouterr().err


def _sharegpt_file(path) -> str:
    conversations = [
        {"conversations": [{"from": "human", "value": f"Tell me about item {i} and its uses."},
                           {"from": "gpt", "value": "It is a thing. " * (2 + i)}]}
        for i in range(6)
    ]  # fmt: skip
    conversations.insert(2, {"conversations": [{"from": "human", "value": "lonely"}]})
    short = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "a long answer"}]
    conversations.insert(3, {"conversations": short})
    path.write_text(json.dumps(conversations))
    return str(path)


def test_vllms_sharegpt_file_drives_the_benchmark(tmp_path):
    """`--dataset-name sharegpt --dataset-path F` as vLLM's: the first turn is the prompt, the
    reply's token count the output length; one-turn and too-short conversations are skipped."""
    from kiln.bench.sharegpt import sharegpt_requests
    from tests.tiny_tokenizer import build_tiny_chat_model

    model = build_tiny_chat_model(str(tmp_path / "chat"))
    data = _sharegpt_file(tmp_path / "sg.json")
    out = tmp_path / "r.json"
    argv = ["bench", "throughput", "--model", model, "--dataset-name", "sharegpt",
            "--dataset-path", data, "--num-prompts", "4", "--no-progress", "--warmup", "0",
            "--output-json", str(out)]  # fmt: skip
    assert main(argv) == 0
    record = json.loads(out.read_text())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    requests = sharegpt_requests(data, 4, lambda t: tok.encode(t, add_special_tokens=False))
    assert record["workload"]["dataset"] == data and len(requests) == 4
    assert record["kiln"]["output_tokens"] == sum(r.output_len for r in requests)
    assert all(len(r.prompt_token_ids) >= 4 for r in requests)
    fixed = sharegpt_requests(data, 3, lambda t: tok.encode(t), output_len=7)
    assert [r.output_len for r in fixed] == [7, 7, 7]
    with pytest.raises(Exception, match="usable conversations"):
        sharegpt_requests(data, 50, lambda t: tok.encode(t))


def test_lora_adapters_run_random_adapters_of_the_models_shapes(tiny_dir, tmp_path):
    # Each request names one of the adapters, which the engine loads and checks against the
    # base's shapes when the request arrives: a wrong shape or module would fail the run.
    out = tmp_path / "lora.json"
    argv = ["bench", "throughput", "--model", tiny_dir, "--num-requests", "4",
            "--input-len", "8", "--output-len", "3", "--no-progress", "--warmup", "0",
            "--lora-adapters", "3", "--lora-rank", "4", "--output-json", str(out)]  # fmt: skip
    assert main(argv) == 0
    record = json.loads(out.read_text())
    assert record["lora"] == {"adapters": 3, "rank": 4}
    assert record["engine_config"]["enable_lora"] and record["engine_config"]["max_loras"] >= 3
    assert record["kiln"]["output_tokens"] == 12


def test_dummy_adapter_reads_as_a_peft_adapter_on_every_projection(tmp_path):
    from kiln.bench.dummy_lora import write_dummy_adapter
    from kiln.lora.peft import PROJECTIONS, read_peft_adapter
    from tests.conftest import tiny_model_config

    cfg = tiny_model_config()
    write_dummy_adapter(cfg, 4, str(tmp_path), seed=1)
    adapter = read_peft_adapter("d", str(tmp_path))
    assert adapter.max_rank == 4
    assert {name for (_, name) in adapter.modules} == set(PROJECTIONS)
