#!/usr/bin/env bash
# Kernel GPU tests, then the layer-stacked decode config sweep (forced splits with and without the
# fused combine) and the prefill sweep.
timeout 110 python3 -m pytest -q -x -m gpu tests/test_kernels_triton_gpu.py -p no:cacheprovider \
  > "$OUT/kernel_tests.txt" 2>&1
grep -E "passed|failed" "$OUT/kernel_tests.txt" | tail -2
timeout "${SWEEP_S:-420}" python3 -m kernels.sweep ${SWEEP_ARGS:---prefill} --out "$OUT" > "$OUT/sweep.log" 2>&1
python3 - <<'P'
import json, os
s = json.load(open(os.environ["OUT"] + "/sweep.json"))["summary"]
print("best decode:", s["decode_best_configs"][:4])
print("best prefill:", s["prefill_best_configs"][:3])
for r in s["best_per_shape"]:
    c = r["cfg"]
    print(r["shape"][:4], r["batch"], r["ctx"], c["tile_n"], c["num_warps"], c["num_stages"],
          c.get("fused_combine"), r["splits"], round(r["ms"] * 1e3, 1))
P
