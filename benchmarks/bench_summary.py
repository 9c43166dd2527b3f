"""One line per `kiln bench` JSON: its name, output tok/s, decode tok/s and the Triton kernels
compiled in its timed run (for a device call's log).

    python3 benchmarks/bench_summary.py $OUT/lat1k*.json
"""

from __future__ import annotations

import json
import os
import sys


def main(paths: list[str]) -> None:
    for path in paths:
        with open(path) as f:
            record = json.load(f)
        kiln = record["kiln"]
        print(
            os.path.basename(path),
            round(kiln["output_tok_s"], 1),
            round(kiln.get("decode_tok_s", 0), 1),
            record.get("kernel_compiles"),
        )


if __name__ == "__main__":
    main(sys.argv[1:])
