#!/usr/bin/env bash
# One device call: the butterfly alone and the captured decoding step, in the tree before the
# change (.ab_old, a `git archive` of the parent commit) and this one, interleaved old/new twice,
# each in a fresh process sharing one Triton cache; then the butterfly's and decoding's parity
# tests on CUDA (every tile forced once: test_every_autotune_tile). Between them, in the same
# call, the host's share of an eager training step (../2026-12-04_h200_device-check-3/).
set -u
HERE=bench/results/2026-12-04_h200_butterfly-few-rows
OUT=${OUT:-/tmp/ab_out}
mkdir -p "$OUT" /tmp/shim_old /tmp/shim_new
ln -sfn "$PWD/.ab_old/kernels" /tmp/shim_old/wiola_kernels
ln -sfn "$PWD/kernels" /tmp/shim_new/wiola_kernels
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/wiola_triton_cache
path() { if [ "$1" = old ]; then echo "/tmp/shim_old:$PWD/.ab_old"; else echo "/tmp/shim_new:$PWD"; fi; }
for label in old new old new; do
  PYTHONPATH=$(path $label) timeout 90 python "$HERE/butterfly_ab.py" "$label" 2>>"$OUT/errors.log" | tee -a "$OUT/butterfly_ab.jsonl"
  PYTHONPATH=$(path $label) timeout 60 python bench/results/2026-12-04_h200_decode-launches/replay_split.py 2>>"$OUT/errors.log" \
    | sed "s/^{/{\"label\": \"$label\", /" | tee -a "$OUT/replay_split.jsonl"
done
PYTHONPATH=$(path new) timeout 100 python bench/results/2026-12-04_h200_device-check-3/train_host_profile.py \
  2>>"$OUT/errors.log" | tee "$OUT/train_host_profile.jsonl"
PYTHONPATH=$(path new) WIOLA_PARITY_ONE_CONFIG=1 timeout 120 python -m pytest -q -p bench.parity_plugin -n 8 \
  tests/test_butterfly.py tests/test_decode.py tests/test_fast.py -k "not torch_compile" 2>&1 | tail -n 15 | tee "$OUT/parity.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$OUT/gpu.txt"
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >>"$OUT/gpu.txt"
