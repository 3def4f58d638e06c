"""Round-robin or contiguous split deal, through identity and random tables: `python3
scripts/device/deal_probe.py OUT.json`

The shipped decode deals a sequence's KV tiles to its splits round robin (split s takes tiles s,
s + S, ...), so the S programs of a sequence stream one window of S adjacent tiles together. Through
an identity table that window is contiguous memory (shared DRAM rows and 2 MB pages across the
programs of different SMs); through a random table it is not, which is one candidate for what a
random table costs. The copies here deal contiguous ranges (split s takes tiles [s C, (s + 1) C),
C = ceil(tiles / S)): each program then streams its own range, and only the blocks of its own
range are near each other.

  contig      C from the sequence's length (correct for any batch; the first tile's block ids
              wait for the length: one memory round trip more before the first K/V load)
  contig_w    C from the table's width (the bench's tables are exactly as wide as the context,
              so this equals `contig` here without the extra round trip: an upper bound)

Decode with the fused combine only (the copies' prefill loop and combine kernel are wrong).
Same caches for every kernel; order per shape: each kernel identity, random, random, identity;
means of two; microseconds per call (`kernels.bench_timing.stack_ms`). Each line gives the largest
difference from the shipped output. Results: results/kernels-deal-h200.md.
"""

from __future__ import annotations

import functools
import json
import pathlib
import sys

import pagedctl.kernels.sweep as sw
import pagedctl.kernels.triton_attention as shipped
import torch
from kernel_copy import edited_copy  # (scripts/device, the script's own folder)
from pagedctl.kernels.bench_timing import _table, per_call_ms

_FIRST = (
    "    first = (split * TILE_N + tl.arange(0, TILE_N)) // BLOCK_SIZE\n"
    "    blk_next = tl.load(bt_row + first, mask=first < bt_cols, other=0)\n"
)


_TILES = "    num_tiles = tl.cdiv(limit, TILE_N)\n"


def _contig(chunk_src: str, early: bool) -> list[tuple[str, str]]:
    load = (
        f"    chunk = {chunk_src}\n"
        "    first = (split * chunk * TILE_N + tl.arange(0, TILE_N)) // BLOCK_SIZE\n"
        "    blk_next = tl.load(bt_row + first, mask=first < bt_cols, other=0)\n"
    )
    edits = [
        ("    col_next = (pos + NUM_SPLITS * TILE_N) // BLOCK_SIZE\n",
         "    col_next = (pos + TILE_N) // BLOCK_SIZE\n"),
        ("        if split >= num_tiles:\n", "        if split * chunk >= num_tiles:\n"),
        ("        for j in range(lo, hi, NUM_SPLITS):\n",
         "        for j in range(lo * chunk, tl.minimum(lo * chunk + chunk, hi)):\n"),
        ("            active = tl.minimum(num_tiles, NUM_SPLITS)\n",
         "            active = tl.cdiv(num_tiles, chunk)\n"),
    ]  # fmt: skip
    if early:
        edits.append((_FIRST, load))
    else:
        edits += [
            (_FIRST, ""),
            (_TILES, _TILES + load),
        ]
    return edits


VARIANTS = {
    "contig": _contig("tl.cdiv(num_tiles, NUM_SPLITS)", early=False),
    "contig_w": _contig("tl.cdiv(tl.cdiv(bt_cols * BLOCK_SIZE, TILE_N), NUM_SPLITS)", early=True),
}

CASES = [  # (shape, batch, context, block)
    ("qwen2.5-0.5b", 8, 32768, 16),
    ("qwen2.5-0.5b", 8, 32768, 32),
    ("smollm2-135m", 8, 32768, 16),
    ("smollm2-135m", 8, 32768, 32),
    ("qwen2.5-0.5b", 64, 2048, 16),
    ("qwen2.5-0.5b", 64, 8192, 16),
    ("qwen2.5-0.5b", 8, 2048, 16),
    ("qwen2.5-0.5b", 1, 32768, 16),
]


def main() -> None:
    mods = {"shipped": shipped} | {n: edited_copy(n, e) for n, e in VARIANTS.items()}
    rows, lines = [], []
    for shape, batch, ctx, block in CASES:
        d = sw.SHAPES[shape][2]
        per_seq = -(-ctx // block)
        tables = {
            "identity": _table(batch, per_seq, True, "cuda"),
            "random": _table(batch, per_seq, False, "cuda"),
        }
        ident = tables["identity"]
        q, pools, lens, cu, _ = sw._pools(shape, batch, ctx, torch.bfloat16, block, ident)
        cfg = sw._shipped(shape, batch)
        args = (lens, cu, 1, ctx, d**-0.5, None, cfg)
        ref = shipped.paged_attention(q, *pools[0][:2], ident, *args).float()
        cells, row = [], dict(shape=shape, batch=batch, ctx=ctx, block=block, us={})
        for name, mod in mods.items():
            stacks = {
                tn: [
                    functools.partial(mod.paged_attention, q, k, v, t, *args) for k, v, _ in pools
                ]
                for tn, t in tables.items()
            }  # fmt: skip
            diff = (stacks["identity"][0]().float() - ref).abs().max().item()
            times: dict[str, list[float]] = {"identity": [], "random": []}
            for tn in ("identity", "random", "random", "identity"):
                times[tn].append(per_call_ms(stacks[tn]) * 1e3)
            us = {k: sum(v) / 2 for k, v in times.items()}
            row["us"][name] = us | {"diff": diff, "times": times}
            cells.append(
                f"{name} I {us['identity']:6.2f} R {us['random']:6.2f} "
                f"({us['random'] / us['identity'] - 1:+.1%}, diff {diff:.0e})"
            )
        line = f"{shape[:5]} {batch:3d} x {ctx:5d} b{block}: " + "  ".join(cells)
        print(line, flush=True)
        lines.append(line)
        rows.append(row)
        del pools, q, stacks
        torch.cuda.empty_cache()
    pathlib.Path(sys.argv[1]).write_text(json.dumps({"rows": rows, "lines": lines}, indent=1))


if __name__ == "__main__":
    main()
