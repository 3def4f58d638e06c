#!/usr/bin/env bash
# The engine GPU tests that ran before the illegal memory access of session 4 (tiny model, KV sizing,
# the bundled model), first plainly, then under compute-sanitizer's memcheck (works on the
# Firecracker machines; slow: CUDA graphs replay kernel by kernel) to name the kernel and address.
# Needs PAGEDCTL_TEST_GGUF (the bundled model in two parts, scripts/device/README.md).
K="tiny_model or kv_cache_is_sized or bundled or cuda_graph_decode"
timeout 150 python3 -m pytest -q -x -m gpu tests/test_llm_gpu.py -k "$K" -p no:cacheprovider \
  > "$OUT/plain.txt" 2>&1
grep -E "passed|failed|^FAILED|illegal" "$OUT/plain.txt" | tail -4
timeout "${SANITIZE_S:-400}" compute-sanitizer --tool memcheck --print-limit 5 --log-file "$OUT/memcheck.txt" \
  python3 -m pytest -q -x -m gpu tests/test_llm_gpu.py -k "$K" -p no:cacheprovider > "$OUT/sanitized.txt" 2>&1
grep -E "passed|failed" "$OUT/sanitized.txt" | tail -2
grep -m 12 -E "Invalid|at .*0x|by thread|Address" "$OUT/memcheck.txt"
