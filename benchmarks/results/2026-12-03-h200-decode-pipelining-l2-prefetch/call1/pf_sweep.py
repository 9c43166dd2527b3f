"""The packed float8 decode kernel with overlapped loads (decode_pf.patch) against today's, one layer, H200.

    git apply decode_pf.patch; PYTHONPATH=.:benchmarks python3 <this folder>/pf_sweep.py --out pf.json
"""
import argparse, json, sys
from functools import partial
import torch
from decode_fp8_dots_sweep import HEAD_DIM, KV_HEADS, PLACEMENT, errors, inputs_and_reference
from tile_sweep import graph_time_ms
from kiln.kernels.triton import decode_attention as da
from kiln.kernels.triton import decode_attention_pf as packed_pf

SHAPES = [(768, 1500, "sequential"), (768, 1500, "random"), (512, 192, "sequential"),
          (64, 4096, "sequential"), (1, 1024, "sequential")]
# (BLOCK_N, warps, k_asm, natural, stages): hand-pipelined in registers (natural 0, 1 stage) or
# loads at use with block ids a tile ahead and the pipeliner's 2-deep buffers (natural 1, 3 stages)
VARIANTS = [(8, 1, 0, 0, 1), (8, 2, 0, 0, 1), (8, 4, 0, 0, 1), (16, 2, 0, 0, 1), (16, 4, 0, 0, 1),
            (32, 4, 0, 0, 1), (8, 2, 1, 0, 1), (16, 4, 1, 0, 1),
            (8, 1, 0, 1, 3), (8, 2, 0, 1, 3), (8, 4, 0, 1, 3), (16, 2, 0, 1, 3), (16, 4, 0, 1, 3),
            (8, 2, 0, 1, 4), (8, 1, 0, 1, 2)]

def main():
    ap = argparse.ArgumentParser(); ap.add_argument("--out", default="pf.json")
    args = ap.parse_args()
    rec = {"gpu": torch.cuda.get_device_name(), "shapes": []}
    scale = HEAD_DIM ** -0.5
    for batch, context, placement in SHAPES:
        PLACEMENT["mode"] = placement
        q, k8, v8, table, lens, kb, vb, ref = inputs_and_reference(batch, context, scale)
        nbytes = 2 * batch * context * KV_HEADS * HEAD_DIM
        def run(kc, vc):
            return da.paged_decode_attention(q, kc, vc, table, lens, scale, context)
        row = {"batch": batch, "context": context, "placement": placement, "variants": []}
        da.PACKED = True
        row["bf16_us"] = graph_time_ms([partial(run, kb, vb)], 20, 3) * 1e3
        row["packed_us"] = graph_time_ms([partial(run, k8, v8)], 20, 3) * 1e3
        row["packed_err"] = errors(run(k8, v8), ref)
        row["packed_TBps"] = nbytes / row["packed_us"] / 1e6
        for bn, w, k_asm, nat, st in VARIANTS:
                e = {"tiles": [bn, w], "k_asm": k_asm, "natural": nat, "stages": st}
                try:
                    f = partial(packed_pf.decode_pf, q, k8, v8, table, lens, scale, context,
                                (bn, w), k_asm=bool(k_asm), natural=bool(nat), stages=st)
                    e["err"] = errors(f(), ref)
                    e["us"] = graph_time_ms([f], 20, 3) * 1e3
                    e["TBps"] = nbytes / e["us"] / 1e6
                except Exception as exc:
                    e["failed"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                row["variants"].append(e)
        timed = [e for e in row["variants"] if "us" in e]
        best = min(timed, key=lambda e: e["us"]) if timed else None
        row["best"] = best
        print(f"{batch}x{context} {placement}: bf16 {row['bf16_us']:.1f} packed {row['packed_us']:.1f} "
              f"({row['packed_TBps']:.2f} TB/s) best pf {best and round(best['us'], 1)} {best and best['tiles']} "
              f"asm={best and best['k_asm']} nat={best and best['natural']},{best and best['stages']} err {best and best['err']['rel_rms']:.2e} vs {row['packed_err']['rel_rms']:.2e}",
              flush=True)
        print("   ", " ".join(f"{e['tiles'][0]},{e['tiles'][1]}{'a' if e['k_asm'] else ''}{'n' + str(e['stages']) if e['natural'] else ''}:{e.get('us', float('nan')):.0f}" for e in row["variants"]), flush=True)
        rec["shapes"].append(row)
        json.dump(rec, open(args.out, "w"), indent=1)

if __name__ == "__main__":
    main()
