#!/usr/bin/env bash
# One device call: the gate alone and the captured decoding step, in the tree before the change
# (.ab_old, a `git archive` of the parent commit) and this one, interleaved old/new twice, each in
# a fresh process sharing one Triton cache; then the gate's and decoding's parity tests on CUDA.
set -u
HERE=bench/results/2026-12-04_h200_gate-heads
OUT=${OUT:-/tmp/ab_out}
mkdir -p "$OUT" /tmp/shim_old /tmp/shim_new
ln -sfn "$PWD/.ab_old/kernels" /tmp/shim_old/wiola_kernels
ln -sfn "$PWD/kernels" /tmp/shim_new/wiola_kernels
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/wiola_triton_cache
path() { if [ "$1" = old ]; then echo "/tmp/shim_old:$PWD/.ab_old"; else echo "/tmp/shim_new:$PWD"; fi; }
for label in old new old new; do
  PYTHONPATH=$(path $label) timeout 60 python "$HERE/gate_ab.py" "$label" 2>>"$OUT/errors.log" | tee -a "$OUT/gate_ab.jsonl"
  PYTHONPATH=$(path $label) timeout 60 python bench/results/2026-12-04_h200_decode-launches/replay_split.py 2>>"$OUT/errors.log" \
    | sed "s/^{/{\"label\": \"$label\", /" | tee -a "$OUT/replay_split.jsonl"
done
PYTHONPATH=$(path new) WIOLA_PARITY_ONE_CONFIG=1 timeout 150 python -m pytest -q -p bench.parity_plugin -n 8 \
  tests/test_gate.py tests/test_decode.py -k "not torch_compile" 2>&1 | tail -n 15 | tee "$OUT/parity.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$OUT/gpu.txt"
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >>"$OUT/gpu.txt"
