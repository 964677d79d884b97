#!/usr/bin/env bash
# Alternates the int8 inner loop alone (int8_widen_rate, from ../2026-12-03_cpu_prompt-amd-zen4/)
# and the instrumented 13m int8 step at batch 1, so each step's per-part rates sit beside the rate
# the same loop reaches alone in the same minute.
for r in 1 2 3 4 5 6; do
  echo "== round $r $(date -u +%H:%M:%S)"
  ./wr | grep "12.6 MB" | head -2
  python run.py int8 1 2>&1 | grep -vi warn
done
