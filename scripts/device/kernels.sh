#!/usr/bin/env bash
# Kernel GPU tests, then the decode/prefill benchmark (graph-timed layer stacks, peers, split scan).
timeout 150 python3 -m pytest -q -m gpu tests/test_kernels_triton_gpu.py -p no:cacheprovider \
  > "$OUT/kernel_tests.txt" 2>&1
grep -E "passed|failed" "$OUT/kernel_tests.txt" | tail -2
timeout 420 python3 -m kernels.bench --out "$OUT" > "$OUT/kernels.log" 2>&1
grep -c "^|" "$OUT/kernels.md" 2>/dev/null; tail -3 "$OUT/kernels.log" | cut -c1-160
