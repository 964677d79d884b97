"""The per-run tables of this folder's README from bench-1.json … bench-3.json:
python tables.py FOLDER (a folder holding the three runs; tg128 alone where they hold no pp512 or
ONNX rows, as after-head-rule/'s)."""

import json
import sys

D = sys.argv[1]
runs = [json.load(open(f"{D}/bench-{i}.json")) for i in (1, 2, 3)]


def rec(run, name):
    return next(b["extra_info"] for b in run["benchmarks"] if b["name"] == name)


short = {"reading the weights": "reading", "the multiply-adds": "multiply-adds"}


def j(vals, f):
    return " / ".join(f.format(v) for v in vals)


print(
    "| weights, batch | tok/s, runs 1 / 2 / 3 | % of read floor | % of compute floor | bound by | beside it, same run |"
)
print("| --- | --- | --- | --- | --- | --- |")
for B in (1, 8):
    for w in ("fp32", "bf16", "int8", "int4"):
        rs = [rec(r, f"test_tg128_cpu[B{B}-P16-N128-{w}]") for r in runs]
        tps = [x["tokens_per_s"] for x in rs]
        comp = [100 * x["compute_floor_s_per_step"] * 128 / x["time_s"] for x in rs]
        bound = "/".join(sorted({short.get(x["bound_by"], x["bound_by"]) for x in rs}))
        if w == "fp32":
            beside = "wiola13m: " + j([x["baselines"]["wiola13m"]["speedup"] for x in rs], "{:.1f}×")
        else:
            other = "int8" if w == "int4" else "fp32"
            o = [rec(r, f"test_tg128_cpu[B{B}-P16-N128-{other}]")["tokens_per_s"] for r in runs]
            beside = f"{other}: " + j([a / b for a, b in zip(tps, o)], "{:.2f}×")
        print(
            f"| {w}, {B} | {j(tps, '{:,.0f}')} | {j([x['pct_read_floor'] for x in rs], '{:.0f}')} | {j(comp, '{:.0f}')} | {bound} | {beside} |"
        )
print()
if not any(b["name"].startswith("test_prefill_cpu") for b in runs[0]["benchmarks"]):
    sys.exit(0)
print("| products, weights | tok/s, runs 1 / 2 / 3 | against `wiola13m` in the same row |")
print("| --- | --- | --- |")
for name, label in (
    ("fp32-products-fp32-weights", "fp32 (oneDNN), fp32"),
    ("fp32-products-fp32-weights-other-gemm", "fp32 (ATen: MKL), fp32"),
    ("bf16-products-fp32-weights", "bf16 (oneDNN, AVX-512 BF16), fp32"),
    ("fp32-products-bf16-weights", "fp32 (oneDNN), bf16"),
    ("fp32-products-int8-weights", "fp32 (oneDNN), int8"),
    ("fp32-products-int4-weights", "fp32 (oneDNN), int4"),
):
    rs = [rec(r, f"test_prefill_cpu[{name}]") for r in runs]
    print(
        f"| {label} | {j([512 / x['time_s'] for x in rs], '{:,.0f}')} | {j([x['baselines']['wiola13m']['speedup'] for x in rs], '{:.2f}×')} |"
    )
print()


def onnx(rs):
    return j([x["tokens"] / x["time_s"] for x in rs], "{:,.0f}")


def ours(rs):
    return j([x["baselines"]["wiola.fast"]["tokens_per_s"] for x in rs], "{:,.0f}")


print("| form | ONNX Runtime B1 | ours B1 | ONNX Runtime B8 | ours B8 |")
print("| --- | --- | --- | --- | --- |")
for form in ("fp32", "int8", "int8-matmul", "int4", "int4-matmul"):
    r1 = [rec(r, f"test_decode_cpu_onnx[B1-P16-N128-{form}]") for r in runs]
    r8 = [rec(r, f"test_decode_cpu_onnx[B8-P16-N128-{form}]") for r in runs]
    print(f"| {form} | {onnx(r1)} | {ours(r1)} | {onnx(r8)} | {ours(r8)} |")
