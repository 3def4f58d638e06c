"""Batch-invariant CPU ops: each row's result depends on that row alone, not on the batch it is in.

The engine's `deterministic` setting runs the projections and attention through these, so that a
request's tokens do not depend on what ran beside it: batch size, chunk boundaries, a prefix
computed by another request, a preemption and its recompute. The ordinary ops are exact in
float32 arithmetic but not in the order of their sums, and that order moves with the batch:

- a GEMM library picks its kernel and blocking by the number of rows (MKL gives one row alone
  other bits than the same row among 64; oneDNN splits the inner dimension differently above 32
  rows), and a decode row and the same position inside a prefill chunk run different shapes;
- the reference attention pads a decode group to its longest sequence and lets SDPA block the
  keys by the padded length, and prefill rows run in chunks whose size changes the kernel.

How these ops fix the order:

- `linear`: rows in tiles of exactly `ROWS` (the last one padded with zeros), one matmul call per
  tile: every call has the same shape, so every row gets the same kernel and the same reduction
  order over the input features, wherever it sits and whatever sits beside it. (Shorter calls
  are not safe: oneDNN's packed matmul gives a row of a 5-row call other bits than the same row
  in a 32-row tile for some shapes.)
- `paged_attention`: the query rows of one sequence and KV head form tiles of `Q_ROWS` rows.
  Every matmul is `[rows, head_dim] x [head_dim, KEY_TILE]` (scores, a sum over `head_dim` only)
  or `[rows, KEY_TILE] x [KEY_TILE, head_dim]` (values); keys past a row's position are masked,
  and a row's softmax is the same with trailing masked keys as without (its sums add exact
  zeros); the value tiles' sums are added in key order, so the sum over keys has one order, set
  by the row's own length. A decode row and a prefill row at the same position take the same
  path. A prefill chunk's tiles of one KV head run as one taller matmul per key tile where a
  probe shows that gives the bits of `Q_ROWS`-row matmuls (`wide_rows_agree`).
  With a sliding window, a group's keys start at a multiple of `KEY_TILE` (the global tile grid:
  position `p` is always column `p % KEY_TILE` of its tile) at or below the first key its first
  row sees; the keys below that (never read: their blocks may be freed) and those outside a
  row's window are masked. Whole key tiles a row sees nothing of, before its first, add exact
  zeros to its softmax sums and outputs, so a row's bits do not depend on where its group's
  keys start. With a soft cap, `tanh` runs in whole-vector pieces, as `silu` does below.

- `silu_and_mul`: every element of `silu` through torch's vectorised loop, never the scalar
  tail whose `exp` rounds otherwise (see the function).

Softmax, accumulation and the scores are float32, as in the reference ops. The ops give the same
bits for any thread count torch uses (the tests compare one and two threads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from . import onednn
from .paged_batch import PagedBatch
from .reference import check_options

ROWS = onednn.PACK_ROWS  # rows per projection call: the row count weights are packed for
Q_ROWS = 4  # query rows (positions x heads of one KV head) per attention tile
KEY_TILE = 128  # keys per step of the sum over values
Q_CHUNK = 256  # prefill positions per attention call: bounds the score matrix's memory
SILU_ALIGN = 64  # elements a gate row is padded to: a multiple of every vector width
SILU_PIECE = 16384  # elements per `silu` call: a multiple of SILU_ALIGN below torch's grain (32768)


def linear(x: Tensor, weight: Tensor, packed: Tensor | None, bias: Tensor | None) -> Tensor:
    """`x @ weight.T (+ bias)` of `[T, in]` rows, `ROWS` rows per matmul call, the last tile
    padded with zeros. `packed`: the weight packed for oneDNN (`onednn.pack`), or None for
    `F.linear`."""
    rows = x.shape[0]
    pad = -rows % ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    if packed is not None:
        parts = [onednn.linear(tile, packed, bias) for tile in x.split(ROWS)]
    else:
        parts = [F.linear(tile, weight, bias) for tile in x.split(ROWS)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out[:rows] if pad else out


def silu_and_mul(x: Tensor) -> Tensor:
    """`silu(gate) * up` of a fused `[T, 2I]` gate/up output, each element of `silu` through the
    vectorised path. torch's elementwise loops run whole vectors and finish a range's last
    elements one at a time, and its `exp` rounds differently in the two; where the ranges end
    depends on the tensor's size and how it is split between threads, so a row's bits moved with
    the batch (float32, `I` not a multiple of 32). Here the gates are copied into rows padded to
    `SILU_ALIGN` elements and `silu` runs on pieces of `SILU_PIECE` elements: each piece is
    below torch's parallel grain (one thread, no split inside it) and a multiple of the vector
    width, so no element is ever a range's tail."""
    half = x.shape[-1] // 2
    width = half + (-half % SILU_ALIGN)
    gate = x.new_zeros(x.shape[0], width)
    gate[:, :half] = x[:, :half]
    flat = gate.view(-1)
    parts = [F.silu(piece) for piece in flat.split(SILU_PIECE)]
    act = (parts[0] if len(parts) == 1 else torch.cat(parts)).view(-1, width)
    return act[:, :half] * x[:, half:]


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    batch: PagedBatch,
    softmax_scale: float,
    *,
    plan_cache: dict | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Causal varlen attention over the paged cache, each row computed in an order set by its own
    position alone; the contract of `kernels.reference.paged_attention` (`window`, `softcap`
    included)."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    check_options(window, softcap)
    key = ("batch_invariant_attention", k_cache.shape[1], tokens, num_heads, num_kv_heads, window)
    plan = None if plan_cache is None else plan_cache.get(key)
    if plan is None:
        plan = _Planner(tokens, num_heads, num_kv_heads, k_cache.shape[1], window).plan(
            batch.block_tables, batch.seq_lens, batch.cu_seqlens_q
        )
        if plan_cache is not None:
            plan_cache[key] = plan
    zero_row = q.new_zeros(1, head_dim, dtype=torch.float32)  # what padding rows of a tile read
    q_flat = torch.cat([q.reshape(-1, head_dim).float(), zero_row])
    out = torch.zeros_like(q_flat)
    k_flat = k_cache.reshape(-1, head_dim)  # row (slot * num_kv_heads + kv head)
    v_flat = v_cache.reshape(-1, head_dim)
    wide = wide_rows_agree(head_dim)
    for g in plan:
        rows = g.q_index.flatten()
        qt = q_flat.index_select(0, rows).view(*g.q_index.shape, head_dim)
        k = k_flat.index_select(0, g.kv_index.flatten()).view(*g.kv_index.shape, head_dim).float()
        v = v_flat.index_select(0, g.kv_index.flatten()).view(*g.kv_index.shape, head_dim).float()
        if g.shared is None:  # tile b reads KV row b
            o = _attend(qt, k, v, g.visible, softmax_scale, softcap)
        else:  # one sequence's tiles: those of KV head h are `shared[h]`, reading KV row h
            o = torch.cat([
                _attend_shared(
                    qt[s], k[h : h + 1], v[h : h + 1], g.visible[s], softmax_scale, wide, softcap
                )
                for h, s in enumerate(g.shared)
            ])  # fmt: skip
        out.index_copy_(0, rows, o.view(-1, head_dim))
    return out[:-1].view(tokens, num_heads, head_dim).to(q.dtype)


def _attend(
    q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float, softcap: float | None = None
) -> Tensor:
    """Attention of query rows `q` `[B, M, D]` over keys and values `[B, L, D]` (`L` a multiple
    of `KEY_TILE`; expanded views are fine), `visible` bool `[B, M, L]`: every matmul is
    `[M, D] x [D, KEY_TILE]` or `[M, KEY_TILE] x [KEY_TILE, D]`, and the key tiles' sums are
    added in key order. `softcap`: scores become `softcap * tanh(scores / softcap)` before the
    mask."""
    length = k.shape[1]
    tiles = range(0, length, KEY_TILE)
    kt = k.transpose(1, 2)
    scores = torch.cat([torch.bmm(q, kt[:, :, lo : lo + KEY_TILE]) for lo in tiles], dim=-1)
    scores.mul_(scale)
    if softcap is not None:
        _tanh_(scores.div_(softcap)).mul_(softcap)
    probs = torch.softmax(scores.masked_fill_(~visible, float("-inf")), dim=-1)
    out = torch.bmm(probs[:, :, :KEY_TILE], v[:, :KEY_TILE])
    for lo in tiles[1:]:
        out += torch.bmm(probs[:, :, lo : lo + KEY_TILE], v[:, lo : lo + KEY_TILE])
    return out


def _tanh_(x: Tensor) -> Tensor:
    """`tanh` in place on a contiguous tensor of a multiple of `SILU_ALIGN` elements, in pieces
    of `SILU_PIECE`: every element through torch's vectorised loop, never a range's scalar tail
    (whose rounding differs), however the tensor is sized or split between threads (see
    `silu_and_mul`)."""
    flat = x.view(-1)
    assert flat.numel() % SILU_ALIGN == 0
    for piece in flat.split(SILU_PIECE):
        piece.tanh_()
    return x


def _attend_shared(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    visible: Tensor,
    scale: float,
    wide: bool,
    softcap: float | None = None,
) -> Tensor:
    """`_attend` of `n` tiles `[n, Q_ROWS, D]` of one KV head (`k`, `v`: `[1, L, D]`): as one
    matmul of `n * Q_ROWS` rows per key tile where that gives the bits of `Q_ROWS`-row matmuls
    (`wide_rows_agree`), else tile by tile."""
    n = q.shape[0]
    if not wide:
        return _attend(q, k.expand(n, -1, -1), v.expand(n, -1, -1), visible, scale, softcap)
    flat_q, flat_visible = q.view(1, -1, q.shape[-1]), visible.view(1, -1, visible.shape[-1])
    return _attend(flat_q, k, v, flat_visible, scale, softcap).view(q.shape)


_WIDE: dict[int, bool] = {}


def wide_rows_agree(head_dim: int) -> bool:
    """Whether attention's matmuls give a `Q_ROWS`-row tile the same bits inside a taller
    matmul, on this machine and BLAS: measured once per head size. The CPU BLAS picks a kernel by
    the row count (MKL: one for up to 3 rows, another from 4), so a prefill chunk's rows can run
    as one matmul per key tile only where this holds; elsewhere they run tile by tile (slower, the
    same bits by construction)."""
    if head_dim not in _WIDE:
        gen = torch.Generator().manual_seed(0)
        agree = True
        for n in (1, 67, 450):  # tiles: 4 to 1,800 rows in one matmul
            q = torch.randn(n, Q_ROWS, head_dim, generator=gen)
            k, v = (torch.randn(1, 2 * KEY_TILE, head_dim, generator=gen) for _ in range(2))
            visible = torch.rand(n, Q_ROWS, 2 * KEY_TILE, generator=gen) < 0.9
            tiled = _attend_shared(q, k, v, visible, 0.125, wide=False)
            agree &= torch.equal(_attend_shared(q, k, v, visible, 0.125, wide=True), tiled)
        _WIDE[head_dim] = agree
    return _WIDE[head_dim]


@dataclass
class _Group:
    """Tiles computed together.

    Attributes:
        q_index: int64 `[B, Q_ROWS]`, each tile row's row of the flattened `[T * H, D]` queries
            (padding rows: the zero row past the end).
        kv_index: int64 `[O, L]`, the row of the flattened `[slots * Hkv, D]` cache that each
            key of each KV row reads, from a multiple of `KEY_TILE` on; positions past a
            sequence's end read its last written slot, and with a window those below the first
            key its first query sees read that key's slot (masked).
        shared: None when tile b reads KV row b (decode); else, for one sequence, the slice of
            tiles of each of its KV heads (KV row h).
        visible: bool `[B, Q_ROWS, L]`, which keys each tile row attends to.
    """

    q_index: Tensor
    kv_index: Tensor
    shared: list[slice] | None
    visible: Tensor


class _Planner:
    """The tiles of one step: every decode row in one group, each prefill sequence in groups of
    up to `Q_CHUNK` positions. The same for every layer of one window, so made once a step."""

    def __init__(
        self,
        tokens: int,
        num_heads: int,
        num_kv_heads: int,
        block_size: int,
        window: int | None = None,
    ) -> None:
        self.pad_row = tokens * num_heads
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.group = num_heads // num_kv_heads
        self.block_size = block_size
        self.window = window

    def plan(self, block_tables: Tensor, seq_lens: Tensor, cu_seqlens_q: Tensor) -> list[_Group]:
        starts = cu_seqlens_q[:-1].to(torch.int64).tolist()
        ends = cu_seqlens_q[1:].to(torch.int64).tolist()
        lens = seq_lens.to(torch.int64).tolist()
        tables = block_tables.to(torch.int64)
        decode: list[tuple[int, int]] = []  # (sequence, its token's row)
        groups = []
        for i, (start, end, seq_len) in enumerate(zip(starts, ends, lens, strict=True)):
            if end - start == 1:
                if seq_len > 0:  # length 0: a decode graph's padding row, attends to nothing
                    decode.append((i, start))
                continue
            for lo in range(start, end, Q_CHUNK):
                hi = min(lo + Q_CHUNK, end)
                first = seq_len - (end - start) + (lo - start)  # position of row lo
                groups.append(self._chunk(tables[i], lo, hi, first))
        if decode:
            groups.append(self._decode(decode, tables, lens))
        return groups

    def _first_key(self, position: int) -> int:
        """The first key a query at `position` sees."""
        return 0 if self.window is None else max(0, position - self.window + 1)

    def _kv_rows(
        self, table: Tensor, length: int, padded: int, start: int = 0, lowest: int = 0
    ) -> Tensor:
        """int64 `[Hkv, padded]`: the flattened-cache row of each key position `start ...` of
        each KV head of a sequence of `length` keys; positions past it read the last one, and
        those below `lowest` (the first key the group's first query sees) read that one."""
        pos = torch.arange(start, start + padded).clamp_(min=lowest, max=length - 1)
        slots = table[pos // self.block_size] * self.block_size + pos % self.block_size
        return slots[None, :] * self.num_kv_heads + torch.arange(self.num_kv_heads)[:, None]

    def _tiles(self, rows: Tensor, fill: int) -> Tensor:
        """`[R]` -> `[ceil(R / Q_ROWS), Q_ROWS]`, padded with `fill`."""
        pad = -rows.numel() % Q_ROWS
        return torch.cat([rows, rows.new_full((pad,), fill)]).view(-1, Q_ROWS)

    def _heads(self, h: int) -> Tensor:
        return torch.arange(h * self.group, (h + 1) * self.group)

    def _chunk(self, table: Tensor, lo: int, hi: int, first: int) -> _Group:
        """Prefill rows `lo:hi` of one sequence (row `lo` at position `first`): per KV head, the
        rows of its query heads, position-major, in tiles."""
        length = first + (hi - lo)  # keys of the chunk's last row
        lowest = self._first_key(first)
        start = _tile_start(lowest)
        padded = _padded(length - start)
        tokens = torch.arange(lo, hi)
        keys = (tokens - lo + first + 1)[:, None].expand(-1, self.group).flatten()
        # a padding row sees one key, never NaN: the first (or, with a window, the first row's)
        fill = 1 if self.window is None else first + 1
        q_tiles, n_keys, shared = [], [], []
        for h in range(self.num_kv_heads):
            rows = (tokens[:, None] * self.num_heads + self._heads(h)[None, :]).flatten()
            tiles = self._tiles(rows, self.pad_row)
            done = sum(t.shape[0] for t in q_tiles)
            shared.append(slice(done, done + tiles.shape[0]))
            q_tiles.append(tiles)
            n_keys.append(self._tiles(keys, fill))
        kv_index = self._kv_rows(table, length, padded, start, lowest)
        visible = _visible(torch.cat(n_keys), padded, start, self.window)
        return _Group(torch.cat(q_tiles), kv_index, shared, visible)

    def _decode(self, decode: list[tuple[int, int]], tables: Tensor, lens: list[int]) -> _Group:
        """One query row per sequence: per sequence and KV head, the rows of its query heads in
        tiles (one tile each unless a KV head serves more than `Q_ROWS` query heads)."""
        lowest = {i: self._first_key(lens[i] - 1) for i, _ in decode}
        starts = {i: _tile_start(lowest[i]) for i, _ in decode}
        padded = _padded(max(lens[i] - starts[i] for i, _ in decode))
        q_tiles, n_keys, kv, tile_starts = [], [], [], []
        for i, row in decode:
            kv_rows = self._kv_rows(tables[i], lens[i], padded, starts[i], lowest[i])
            for h in range(self.num_kv_heads):
                tiles = self._tiles(row * self.num_heads + self._heads(h), self.pad_row)
                q_tiles.append(tiles)
                n_keys.append(torch.full(tiles.shape, lens[i]))
                kv.append(kv_rows[h : h + 1].expand(tiles.shape[0], -1))
                tile_starts.append(torch.full(tiles.shape[:1], starts[i]))
        start = torch.cat(tile_starts)[:, None, None] if self.window is not None else 0
        visible = _visible(torch.cat(n_keys), padded, start, self.window)
        return _Group(torch.cat(q_tiles), torch.cat(kv), None, visible)


def _padded(length: int) -> int:
    """`length` keys rounded up to whole `KEY_TILE`s."""
    return -(-length // KEY_TILE) * KEY_TILE


def _tile_start(position: int) -> int:
    """The first position of the `KEY_TILE` tile of the global grid that holds `position`."""
    return position // KEY_TILE * KEY_TILE


def _visible(
    n_keys: Tensor, padded: int, start: int | Tensor = 0, window: int | None = None
) -> Tensor:
    """bool `[B, Q_ROWS, padded]`: key `start + l` is visible to a row that sees `n_keys` keys,
    those below `n_keys` (with a window, only the last `window` of them); `start`: an int, or a
    tensor `[B, 1, 1]` of each tile's."""
    keys = start + torch.arange(padded)[None, None, :]
    visible = keys < n_keys[:, :, None]
    if window is not None:
        visible &= keys >= n_keys[:, :, None] - window
    return visible
