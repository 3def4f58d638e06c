#!/usr/bin/env bash
# Nsight Compute on the decode attention kernel at batch 64 x 2K (the shapes short of 75% of the
# copy bandwidth): the shipped config and one program per (sequence, KV head) with no split.
# Reports come back as ncu.tgz (with stalls.txt: the warp-stall samples per reason and
# instruction); the summaries print.
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
mkdir -p /tmp/ncu
run() {  # name, then ncu_decode.py's arguments
  local name=$1; shift
  timeout 150 "$NCU" --clock-control none -k regex:_attn_fwd --launch-skip 3 --launch-count 1 \
    --set full --import-source yes -f -o "/tmp/ncu/$name" \
    python3 scripts/device/ncu_decode.py "$@" > "/tmp/ncu/$name.log" 2>&1
  "$NCU" --import "/tmp/ncu/$name.ncu-rep" --page details > "/tmp/ncu/$name.txt" 2>&1
  "$NCU" --import "/tmp/ncu/$name.ncu-rep" --page source --csv --print-source sass \
    > "/tmp/ncu/$name.sass.csv" 2>/dev/null
  echo "== $name"
  grep -E "^ +(Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Dynamic Shared|Waves Per SM|Block Limit|Theoretical Occ|Stall|L2 Hit|L1/TEX Hit|Issue Slots|Warp Cycles Per Issued)" "/tmp/ncu/$name.txt" | head -30
}
run qwen_policy qwen2.5-0.5b 64 2048
run qwen_split1 qwen2.5-0.5b 64 2048 1 64 4 3 0
run smol_policy smollm2-135m 64 2048
python3 scripts/device/ncu_stalls.py /tmp/ncu qwen_policy qwen_split1 smol_policy > /tmp/ncu/stalls.txt
tar czf "$OUT/ncu.tgz" -C /tmp/ncu .
