#!/usr/bin/env bash
# The seed recipes (W2-W4) and the capacity probe, each writing its tables under $OUT/results.
mkdir -p "$OUT/results"
for n in seed-shared-prefix seed-block-size seed-oversubscribed; do
  timeout 150 python3 -m pagedctl sweep --recipe recipes/$n.yaml --out "$OUT/results" \
    > "$OUT/$n.log" 2>&1
  echo "$n rc=$?"
done
timeout 90 python3 -m pagedctl capacity --model qwen2.5-0.5b-instruct --gpu-mem 0.85,0.7,0.95 \
  --max-len 2048 --dist lognormal:mean=260,median=180 --no-sim --probe --name probe-h200 \
  --out "$OUT/results" > "$OUT/probe.log" 2>&1
echo "probe rc=$?"
