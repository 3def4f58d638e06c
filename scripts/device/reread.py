"""Redo the plain-read column of a `kernels.bench` JSON on this GPU: `python3
scripts/device/reread.py IN.json OUT.json` (session 6: the first run scaled the time of an
oversized read down to the asked bytes, which is wrong for small reads)."""

import json
import sys
from pathlib import Path

import torch
from pagedctl.kernels.bench import SHAPES
from pagedctl.kernels.bench_timing import read_floor_ms

data = json.loads(Path(sys.argv[1]).read_text())
for row in data["peers"]:
    _, hkv, d = SHAPES[row["shape"]]
    nbytes = 2 * row["batch"] * row["context"] * hkv * d * 2
    row["ms_read"], row["read_per_sm"] = read_floor_ms(nbytes, torch.device("cuda"))
    print(row["shape"][:5], row["batch"], row["context"], f"{row['ms_read'] * 1e3:.1f} us")
    torch.cuda.empty_cache()
Path(sys.argv[2]).write_text(json.dumps(data, indent=1))
