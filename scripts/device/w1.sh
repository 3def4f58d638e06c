#!/usr/bin/env bash
# W1 ("nano-bench"): pagedctl and the three transformers peers in one run.
timeout 560 python3 -m pagedctl bench --recipe recipes/nano-bench.yaml --out "$OUT" \
  > "$OUT/nano-bench.log" 2>&1
tail -12 "$OUT/nano-bench.log" | cut -c1-160
