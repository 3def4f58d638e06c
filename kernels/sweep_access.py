"""How decode reaches memory, as A/B experiments on a CUDA device (`python -m kernels.sweep
--pdl | --layout | --tables --out DIR` runs them): a programmatic dependent launch behind
`write_kv`, token- against head-major cache storage, and block tables of growing locality. Each
times the shipped decode config in the layer-stack graphs of `kernels.bench_timing`.
"""

from __future__ import annotations

import functools
import itertools
import json
from dataclasses import replace
from pathlib import Path

import torch
from pagedctl.kernels.bench import SHAPES
from pagedctl.kernels.bench_timing import _table, num_layers, per_call_ms, read_floor_ms
from pagedctl.kernels.sweep import _pools, _shipped
from pagedctl.kernels.triton_attention import paged_attention
from pagedctl.kernels.triton_kv import write_kv

PDL_SHAPES = [(1, 8192), (64, 512), (64, 2048), (64, 8192), (256, 2048)]
# `--layout`: (shape, batch, context, block), the shapes whose random-table overhead or bandwidth
# missed the targets in results/kernels-h200.md, plus two that met them.
LAYOUT_SHAPES = [
    ("qwen2.5-0.5b", 64, 2048, 16), ("qwen2.5-0.5b", 64, 2048, 32),
    ("qwen2.5-0.5b", 1, 32768, 32), ("qwen2.5-0.5b", 8, 32768, 32),
    ("smollm2-135m", 64, 32768, 16), ("smollm2-135m", 8, 32768, 32),
    ("smollm2-135m", 1, 32768, 32), ("smollm2-135m", 64, 2048, 16),
    ("qwen2.5-0.5b", 64, 8192, 16),
]  # fmt: skip


# `--tables`: where the random table costs most (session 7's bench), and a reference shape
TABLE_SHAPES = [
    ("smollm2-135m", 8, 32768, 16), ("smollm2-135m", 8, 32768, 64),
    ("qwen2.5-0.5b", 8, 32768, 16), ("qwen2.5-0.5b", 8, 32768, 32),
    ("qwen2.5-0.5b", 64, 512, 32), ("smollm2-135m", 64, 2048, 16),
]  # fmt: skip
TABLE_RUNS = (1, 8, 64, 512)  # consecutive blocks per run: 1 = a random table
PAGE_BYTES = 2 * 2**20  # the GPU's large page, the unit of address translation for big buffers


def pdl(out: Path, rows: list[dict], dtype, block: int = 16) -> None:
    """The shipped decode config with and without `pdl`, on PDL_SHAPES: alone (a stack of
    attention calls, as `kernels.bench` times them) and behind the `write_kv` of each sequence's
    newest token, as a layer of the engine runs them; attention's own time there is the pair's
    time less a stack of the writes alone (a programmatic launch only overlaps the kernel just
    before it, which in the engine is that write, not another attention)."""
    for shape, (batch, ctx) in itertools.product(SHAPES, PDL_SHAPES):
        q, pools, lens, cu, scale = _pools(shape, batch, ctx, dtype, block)
        _, hkv, d = SHAPES[shape]
        last = lens.long() - 1
        new = torch.randn(2, batch, hkv, d, dtype=dtype, device="cuda")
        slots = [
            t.long().gather(1, (last // block)[:, None])[:, 0] * block + last % block
            for _, _, t in pools
        ]
        for pdl in (False, True):
            cfg = replace(_shipped(shape, batch), pdl=pdl)
            writes = [
                functools.partial(write_kv, new[0], new[1], k, v, at, release_dependents=pdl)
                for (k, v, _), at in zip(pools, slots, strict=True)
            ]
            write_ms = per_call_ms(writes)
            attn = [
                functools.partial(paged_attention, q, k, v, t, lens, cu, 1, ctx, scale, None, cfg)
                for k, v, t in pools
            ]
            pairs = [call for pair in zip(writes, attn, strict=True) for call in pair]
            rows.append(
                {"phase": "pdl", "shape": shape, "batch": batch, "ctx": ctx, "cfg": cfg.__dict__,
                 "splits": "policy", "ms": per_call_ms(attn), "ms_write_kv": write_ms,
                 "ms_after_write_kv": 2 * per_call_ms(pairs) - write_ms}
            )  # fmt: skip
            r = rows[-1]
            print(f"{shape[:5]} {batch:4d} x {ctx:5d} pdl={pdl!s:5}: alone "
                  f"{r['ms'] * 1e3:6.1f} us, after write_kv {r['ms_after_write_kv'] * 1e3:6.1f} "
                  f"us (write_kv {write_ms * 1e3:.1f} us)")  # fmt: skip
        torch.cuda.empty_cache()
        (out / "sweep.json").write_text(json.dumps({"rows": rows}, indent=1))


def layouts(out: Path, rows: list[dict], dtype) -> None:
    """The shipped config on LAYOUT_SHAPES over two cache layouts, each with a random and an
    identity block table over the same caches: "token" (the engine's `[block, token, head,
    dim]`: a program reads `dim` elements every `heads * dim`) and "head" (`[block, head,
    token, dim]` seen through a permuted view: one contiguous run of `block * dim` per block),
    timed token r/i, head r/i, head i/r, token i/r; and a plain read of the same bytes."""
    for shape, batch, ctx, block in LAYOUT_SHAPES:
        hq, hkv, d = SHAPES[shape]
        per_seq = -(-ctx // block)
        n = batch * per_seq
        kv_bytes = 2 * n * block * hkv * d * torch.finfo(dtype).bits // 8
        layers = num_layers(kv_bytes)
        tables = {
            "random": _table(batch, per_seq, False, "cuda"),
            "identity": _table(batch, per_seq, True, "cuda"),
        }
        caches = {
            "token": [
                [torch.randn(n, block, hkv, d, dtype=dtype, device="cuda") for _ in "kv"]
                for _ in range(layers)
            ],
            "head": [
                [
                    torch.randn(n, hkv, block, d, dtype=dtype, device="cuda").transpose(1, 2)
                    for _ in "kv"
                ]
                for _ in range(layers)
            ],
        }
        q = torch.randn(batch, hq, d, dtype=dtype, device="cuda")
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        cfg = _shipped(shape, batch)
        order = [("token", "random"), ("token", "identity"), ("head", "random"),
                 ("head", "identity")]  # fmt: skip
        times: dict = {}
        for layout, table in order + order[::-1]:
            calls = [
                functools.partial(paged_attention, q, k, v, tables[table], lens, cu, 1, ctx,
                                  d**-0.5, None, cfg)
                for k, v in caches[layout]
            ]  # fmt: skip
            times.setdefault((layout, table), []).append(per_call_ms(calls))
        ms = {f"{lay}_{tab}": sum(t) / 2 for (lay, tab), t in times.items()}
        floor_ms, per_sm = read_floor_ms(kv_bytes, torch.device("cuda"))
        row = {"phase": "layout", "shape": shape, "batch": batch, "ctx": ctx, "block": block,
               "layers": layers, "bytes": kv_bytes, "cfg": cfg.__dict__, **ms,
               "read_floor_ms": floor_ms, "read_floor_programs_per_sm": per_sm}  # fmt: skip
        rows.append(row)
        print(
            f"{shape[:5]} {batch:3d} x {ctx:5d} b{block}: token {ms['token_random'] * 1e3:6.1f} "
            f"us ({ms['token_random'] / ms['token_identity'] - 1:+.1%} random), head "
            f"{ms['head_random'] * 1e3:6.1f} us ({ms['head_random'] / ms['head_identity'] - 1:+.1%}"
            f"), read {floor_ms * 1e3:6.1f} us ({per_sm}/SM)"
        )
        del caches
        torch.cuda.empty_cache()
        (out / "sweep.json").write_text(json.dumps({"rows": rows}, indent=1))


def runs_table(batch: int, per_seq: int, run: int, device) -> torch.Tensor:
    """A block table over `batch * per_seq` blocks made of runs of `run` consecutive block ids
    in shuffled order: 1 is a random table, `batch * per_seq` the identity."""
    n = batch * per_seq
    runs = torch.arange(n, device=device).split(run)
    order = torch.randperm(len(runs)).tolist()
    return torch.cat([runs[i] for i in order]).view(batch, per_seq).to(torch.int32)


def in_page_table(batch: int, per_seq: int, page_blocks: int, device) -> torch.Tensor:
    """A block table whose ids are shuffled only within each group of `page_blocks` consecutive
    ids (one memory page of blocks, where the pool starts on a page boundary), the groups kept in
    order: random at every scale below a page, the identity above it."""
    n = batch * per_seq
    groups = torch.arange(n, device=device).split(page_blocks)
    perm = [g[torch.randperm(len(g), device=device)] for g in groups]
    return torch.cat(perm).view(batch, per_seq).to(torch.int32)


def tables(out: Path, rows: list[dict], dtype) -> None:
    """The shipped config on TABLE_SHAPES through tables of growing locality over the same
    caches (every layer through the same table, as the engine's): random, runs of TABLE_RUNS
    consecutive blocks shuffled, identity; timed in that order and back. Where the random
    table's cost comes from: runs as long as a memory page (2 MB) would remove address
    translation misses, short runs DRAM-row or sector effects."""
    for shape, batch, ctx, block in TABLE_SHAPES:
        _, hkv, d = SHAPES[shape]
        per_seq = -(-ctx // block)
        n = batch * per_seq
        tables = {f"runs of {r}": runs_table(batch, per_seq, r, "cuda") for r in TABLE_RUNS}
        block_bytes = block * hkv * d * torch.finfo(dtype).bits // 8
        if PAGE_BYTES % block_bytes == 0:  # pages hold whole blocks: shuffle within each
            tables["in pages"] = in_page_table(batch, per_seq, PAGE_BYTES // block_bytes, "cuda")
        tables["identity"] = runs_table(batch, per_seq, n, "cuda")
        q, pools, lens, cu, _ = _pools(shape, batch, ctx, dtype, block, tables["identity"])
        # (a page-aligned pool is what makes "in pages" mean whole pages; torch's caching
        # allocator gives large buffers 2 MB-aligned segments, checked here)
        aligned = all(k.data_ptr() % PAGE_BYTES == 0 for k, _, _ in pools)
        cfg = _shipped(shape, batch)
        times: dict = {}
        for name in [*tables, *reversed(tables)]:
            calls = [
                functools.partial(paged_attention, q, k, v, tables[name], lens, cu, 1, ctx,
                                  d**-0.5, None, cfg)
                for k, v, _ in pools
            ]  # fmt: skip
            times.setdefault(name, []).append(per_call_ms(calls))
        ms = {name: sum(t) / 2 for name, t in times.items()}
        rows.append({"phase": "tables", "shape": shape, "batch": batch, "ctx": ctx,
                     "block": block, "block_bytes": block_bytes, "pages_aligned": aligned,
                     "cfg": cfg.__dict__,
                     "ms": ms, "times": times})  # fmt: skip
        cells = ", ".join(
            f"{name} {m / ms['identity'] - 1:+.1%}" for name, m in ms.items() if name != "identity"
        )
        print(f"{shape[:5]} {batch:3d} x {ctx:5d} b{block} ({block_bytes} B a block, pool "
              f"{'' if aligned else 'not '}page-aligned): identity "
              f"{ms['identity'] * 1e3:6.1f} us; {cells}")  # fmt: skip
        del pools
        torch.cuda.empty_cache()
        (out / "sweep.json").write_text(json.dumps({"rows": rows}, indent=1))
