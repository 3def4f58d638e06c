#!/usr/bin/env bash
# Kernel GPU tests, then the decode/prefill benchmark of one model's shapes (graph-timed layer
# stacks, peers, split scan): `scripts/device/kernels.sh qwen2.5-0.5b` in one call,
# `SKIP_TESTS=1 scripts/device/kernels.sh smollm2-135m` in the next (each run takes ~4.5 min:
# both do not fit one call's 10 minutes). Merge the two kernels.json files afterwards with
# `python -m kernels.bench --out results --render qwen.json smollm2.json`.
shape="${1:-qwen2.5-0.5b}"
if [ -z "$SKIP_TESTS" ]; then
  timeout 170 python3 -m pytest -q -m gpu tests/test_kernels_triton_gpu.py -p no:cacheprovider \
    > "$OUT/kernel_tests.txt" 2>&1
  grep -E "passed|failed" "$OUT/kernel_tests.txt" | tail -2
fi
timeout 400 python3 -m kernels.bench --out "$OUT" --shapes "$shape" > "$OUT/kernels.log" 2>&1
grep -c "^| $shape" "$OUT/kernels.md" 2>/dev/null; tail -3 "$OUT/kernels.log" | cut -c1-160
