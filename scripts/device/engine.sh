#!/usr/bin/env bash
# Engine GPU tests (graphs vs eager, memory sizing, parity with transformers, fused kernels) and
# the batch-256 decode step against its memory-bandwidth floor. A call returns at most 8 files:
# the profiler tables come back in one tarball.
timeout 240 python3 -m pytest -q -m gpu tests/test_llm_gpu.py tests/test_model_parity.py \
  tests/test_kernels_fused.py tests/test_capacity_probe.py -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1
grep -E "passed|failed|^FAILED" "$OUT/gpu_tests.txt" | tail -5
mkdir -p /tmp/step
timeout 220 python3 -m pagedctl.bench_step --batch 256 64 --num-scheduler-steps 1 8 --profile --out /tmp/step > "$OUT/step.txt" 2>&1
grep -A1 "^batch" "$OUT/step.txt"
cp /tmp/step/decode_step.json "$OUT/" 2>/dev/null
tar czf "$OUT/profiles.tgz" -C /tmp/step . 2>/dev/null
