"""Warp-stall samples of Nsight Compute SASS source pages, summed per reason and per instruction:
`python scripts/device/ncu_stalls.py DIR NAME...` reads DIR/NAME.sass.csv (as `ncu.sh` writes
them with `ncu --import REP --page source --csv --print-source sass`)."""

import csv
import sys
from pathlib import Path

folder = Path(sys.argv[1])
for name in sys.argv[2:]:
    rows = list(csv.reader((folder / f"{name}.sass.csv").open()))
    header, data = rows[1], [r for r in rows[2:] if len(r) >= len(rows[1])]
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples = "Warp Stall Sampling (All Samples)"
    total = sum(int(r[col[samples]] or 0) for r in data)
    print(f"== {name} samples {total} instructions {len(data)}")
    per_reason = {s: sum(int(r[col[s]] or 0) for r in data) for s in reasons}
    for s, v in sorted(per_reason.items(), key=lambda x: -x[1])[:8]:
        print(f"  {s:24s} {v:6d} {v / total:6.1%}")
    print("  top instructions:")
    for r in sorted(data, key=lambda r: -int(r[col[samples]] or 0))[:22]:
        n = int(r[col[samples]] or 0)
        top = sorted(((s, int(r[col[s]] or 0)) for s in reasons), key=lambda x: -x[1])[:2]
        source = r[col["Source"]].strip()[:70]
        print(f"   {n:5d} {n / total:5.1%} {r[col['Address']][-5:]} {source:70s} {top}")
