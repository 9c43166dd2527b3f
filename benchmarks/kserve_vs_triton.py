"""kiln's KServe v2 answers beside a real Triton Inference Server's, on the same declaration.

    python benchmarks/kserve_vs_triton.py --write-repo DIR
        a Triton model repository: `tensorrt_llm` with kiln's declaration (config.pbtxt written
        from kiln.server.kserve.models) and a Python-backend model that echoes its input ids,
        so Triton's own checks (datatype, shape, names, batch) run before any model code.
    python benchmarks/kserve_vs_triton.py --triton http://HOST:PORT --kiln http://HOST:PORT
        sends the same requests to both and prints (and with --output-json records) each one's
        status and message, and whether the model metadata agree.

Triton comes from the `nvidia-pytriton` wheel (its bin/tritonserver and Python-backend stubs; the
stub needs Python 3.12, in a venv of its own). On a CPU machine:

    python3.12 -m venv /tmp/pyt && /tmp/pyt/bin/pip install nvidia-pytriton==0.7.0
    TS=/tmp/pyt/lib/python3.12/site-packages/pytriton/tritonserver
    cp $TS/python_backend_stubs/3.12/triton_python_backend_stub $TS/backends/python/
    python benchmarks/kserve_vs_triton.py --write-repo /tmp/repo
    PATH=/tmp/pyt/bin:$PATH LD_LIBRARY_PATH=$PYTHON312_PREFIX/lib:$TS/lib \\
      PYTHONPATH=/tmp/pyt/lib/python3.12/site-packages \\
      $TS/bin/tritonserver --model-repository /tmp/repo --backend-directory $TS/backends \\
      --http-port 18000 --grpc-port 18001 --metrics-port 18002 --http-address 127.0.0.1 &
    kiln serve --port 18100 --max-model-len 512 &
    python benchmarks/kserve_vs_triton.py --triton http://127.0.0.1:18000 \\
      --kiln http://127.0.0.1:18100 --output-json result.json

Where they differ, kiln is stricter on purpose: a malformed tensor is the client's error (400,
never Triton's 500), and a request parameter kiln would ignore is refused.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import httpx

from kiln.server.kserve.models import TENSORRT_LLM

ECHO_MODEL = """import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
            lengths = np.full((ids.shape[0], 1), ids.shape[1], dtype=np.int32)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("output_ids", ids[:, None, :].astype(np.int32)),
                pb_utils.Tensor("sequence_length", lengths),
            ]))
        return responses
"""


def config_pbtxt(max_batch_size: int = 8) -> str:
    def tensor(t, is_input: bool) -> str:
        dims = ", ".join(str(d) for d in t.dims)
        optional = " optional: true" if is_input and t.optional else ""
        return f'  {{ name: "{t.name}" data_type: TYPE_{t.datatype} dims: [ {dims} ]{optional} }}'

    lines = ['name: "tensorrt_llm"', 'backend: "python"', f"max_batch_size: {max_batch_size}"]
    lines += ["input [", ",\n".join(tensor(t, True) for t in TENSORRT_LLM.inputs), "]"]
    lines += ["output [", ",\n".join(tensor(t, False) for t in TENSORRT_LLM.outputs), "]"]
    lines += ["instance_group [ { count: 1 kind: KIND_CPU } ]"]
    return "\n".join(lines) + "\n"


def write_repo(root: pathlib.Path) -> None:
    model = root / "tensorrt_llm"
    (model / "1").mkdir(parents=True, exist_ok=True)
    (model / "config.pbtxt").write_text(config_pbtxt())
    (model / "1" / "model.py").write_text(ECHO_MODEL)


def _body(**overrides) -> dict:
    inputs = {
        "input_ids": {"datatype": "INT32", "shape": [1, 3], "data": [1, 2, 3]},
        "input_lengths": {"datatype": "INT32", "shape": [1, 1], "data": [3]},
        "request_output_len": {"datatype": "INT32", "shape": [1, 1], "data": [2]},
    }
    for name, value in overrides.items():
        if value is None:
            inputs.pop(name)
        else:
            inputs[name] = value
    return {"inputs": [{"name": n, **v} for n, v in inputs.items()]}


# Protocol-level cases: Triton's core checks these before a model sees the request.
CASES = {
    "valid": _body(),
    "wrong datatype": _body(input_ids={"datatype": "INT64", "shape": [1, 3], "data": [1, 2, 3]}),
    "wrong shape (no batch dim)": _body(
        input_ids={"datatype": "INT32", "shape": [3], "data": [1, 2, 3]}
    ),
    "missing required input": _body(request_output_len=None),
    "undeclared input": _body(draft_logits={"datatype": "FP32", "shape": [1, 1], "data": [0.5]}),
    "data count != shape": _body(input_ids={"datatype": "INT32", "shape": [1, 4], "data": [1, 2]}),
    "float in INT32 data": _body(
        input_ids={"datatype": "INT32", "shape": [1, 3], "data": [1, 2.5, 3]}
    ),
    "batch sizes differ": _body(
        input_lengths={"datatype": "INT32", "shape": [2, 1], "data": [3, 3]}
    ),
    "undeclared output": {**_body(), "outputs": [{"name": "generation_logits"}]},
    "unknown request parameter": {**_body(), "parameters": {"sequence_id": 3}},
}


def compare(triton: str, kiln: str) -> dict:
    rows = {}
    with httpx.Client(timeout=120) as client:
        for case, body in CASES.items():
            row = {}
            for name, base in (("triton", triton), ("kiln", kiln)):
                reply = client.post(f"{base}/v2/models/tensorrt_llm/infer", json=body)
                error = reply.json().get("error") if reply.status_code != 200 else None
                row[name] = {"status": reply.status_code, "error": error}
            rows[case] = row
        raw = {"not JSON": b"{not json"}
        for case, content in raw.items():
            rows[case] = {
                name: {
                    "status": client.post(
                        f"{base}/v2/models/tensorrt_llm/infer", content=content
                    ).status_code
                }
                for name, base in (("triton", triton), ("kiln", kiln))
            }
        for case, path in (
            ("unknown model metadata", "/v2/models/nope"),
            ("unknown model ready", "/v2/models/nope/ready"),
        ):
            rows[case] = {
                name: {"status": client.get(base + path).status_code}
                for name, base in (("triton", triton), ("kiln", kiln))
            }
        meta = {
            name: client.get(f"{base}/v2/models/tensorrt_llm").json()
            for name, base in (("triton", triton), ("kiln", kiln))
        }
    tensors = lambda m: [(t["name"], t["datatype"], t["shape"]) for t in m["inputs"] + m["outputs"]]
    return {
        "cases": rows,
        "metadata_tensors_equal": tensors(meta["triton"]) == tensors(meta["kiln"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-repo", type=pathlib.Path)
    parser.add_argument("--triton")
    parser.add_argument("--kiln")
    parser.add_argument("--output-json", type=pathlib.Path)
    args = parser.parse_args()
    if args.write_repo:
        write_repo(args.write_repo)
        return 0
    if not (args.triton and args.kiln):
        parser.error("give --write-repo DIR, or --triton URL and --kiln URL")
    result = compare(args.triton.rstrip("/"), args.kiln.rstrip("/"))
    for case, row in result["cases"].items():
        t, k = row["triton"], row["kiln"]
        print(f"{case:28s} triton {t['status']}  kiln {k['status']}  {t.get('error') or ''}")
    print("metadata tensors equal:", result["metadata_tensors_equal"])
    if args.output_json:
        args.output_json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
