#!/usr/bin/env bash
# The seed recipes (W2-W4) and the capacity probe. They write ~17 files and a call returns at most
# 8, so everything goes to /tmp/seeds and comes back as $OUT/seeds.tgz.
R=/tmp/seeds
mkdir -p "$R/results"
for n in seed-shared-prefix seed-block-size seed-oversubscribed; do
  timeout 150 python3 -m pagedctl sweep --recipe recipes/$n.yaml --out "$R/results" \
    > "$R/$n.log" 2>&1
  echo "$n rc=$?"
done
timeout 90 python3 -m pagedctl capacity --model qwen2.5-0.5b-instruct --gpu-mem 0.85,0.7,0.95 \
  --max-len 2048 --dist lognormal:mean=260,median=180 --no-sim --probe --name probe-h200 \
  --out "$R/results" > "$R/probe.log" 2>&1
echo "probe rc=$?"
tar czf "$OUT/seeds.tgz" -C "$R" .
