#!/usr/bin/env bash
# The decode step against its floor (1 and 8 steps a window), the attention pool diagnostic
# and the layer-stacked decode config sweep.
timeout 200 python3 -m pagedctl.bench_step --batch 256 --num-scheduler-steps 1 8 --profile --out "$OUT" > "$OUT/step.log" 2>&1
grep -A1 "^batch" "$OUT/step.log"
timeout 90 python3 scripts/device/pool_probe.py "$OUT/pool.json" 256:1074 2>&1 | tail -1
timeout 280 python3 -m kernels.sweep --out "$OUT" > "$OUT/sweep.log" 2>&1
python3 - <<'P'
import json, os
s = json.load(open(os.environ["OUT"] + "/sweep.json"))["summary"]
print("best configs:", s["decode_best_configs"][:3])
for r in s["best_per_shape"]:
    print(r["shape"], r["batch"], r["ctx"], r["cfg"]["tile_n"], r["cfg"]["num_warps"], r["cfg"]["num_stages"], r["splits"], round(r["ms"] * 1e3, 1))
P
