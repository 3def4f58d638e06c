"""How the kernel benchmark times things on a CUDA device: a call as one node of a layer stack in
a CUDA graph (as a decode step replays them), the card's copy bandwidth and matmul rate, an empty
kernel's and a plain read's cost in the same kind of graph, and K/V pools laid out as the engine
lays them out. Used by `benchmarks.kernels` and `benchmarks.step`.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from pagedctl.kernels import empty_kv_cache
from pagedctl.kernels.triton_attention import _device_info


def _ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


LAYER_BYTES = 512 * 2**20  # the layers of one timed graph read at least this much (>> L2)
MAX_LAYERS = 24


def num_layers(bytes_per_layer: int) -> int:
    """Layers (distinct caches) per timed graph: enough that no layer's data is still in L2."""
    return max(4, min(MAX_LAYERS, -(-LAYER_BYTES // bytes_per_layer)))


GRAPH_REPEATS = 4  # the stack is timed once and this many times over, in two graphs


def _graph_ms(calls, repeats: int) -> float:
    """Milliseconds per replay of one CUDA graph holding `calls` back to back, `repeats` times."""
    for call in calls:
        call()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(repeats):
            for call in calls:
                call()
    return _ms(g.replay)


def stack_ms(calls, repeats: int = GRAPH_REPEATS) -> tuple[float, float]:
    """(milliseconds per call, milliseconds the graph's own launch adds to a replay) of `calls`
    (one callable per layer) in CUDA graphs, as the engine's decode step replays them.

    A call's time is what one more call adds to a graph: (the stack `repeats` times over - the
    stack once) / ((repeats - 1) * len(calls)), each call behind the previous one on cold data
    (the stack is sized past L2). The rest of a replay is what the graph pays once, its launch
    and its first node's start (on an H200, 3.7 us for empty kernels and ~10 us for the stack of
    8 attention calls at batch 64 x 2K): a decode step pays it once for all of its kernels, so
    it is no one kernel's cost, yet spread over a stack of 8 calls it added ~1.2 us to each.
    """
    once, many = _graph_ms(calls, 1), _graph_ms(calls, repeats)
    per_call = (many - once) / ((repeats - 1) * len(calls))
    return per_call, once - per_call * len(calls)


def per_call_ms(calls) -> float:
    """Milliseconds per call of `calls` in a CUDA graph of back-to-back calls (see `stack_ms`)."""
    return stack_ms(calls)[0]


@triton.jit
def _empty(x_ptr):
    pass


def empty_kernel_ms(device: torch.device) -> tuple[float, float]:
    """(milliseconds per call, milliseconds of the graph's launch) of a kernel that does nothing,
    in the same kind of layer-stack graph: the part of every figure below that no kernel can
    remove (launch and drain of a graph node), and what a replay pays once."""
    x = torch.empty(1, device=device)
    return stack_ms([lambda: _empty[(1,)](x)] * MAX_LAYERS)


@triton.jit
def _read_sum(x_ptr, out_ptr, per_program, BLOCK: tl.constexpr):
    """Sum program `p`'s contiguous `per_program` elements (a multiple of BLOCK) of `x`."""
    start = tl.program_id(0).to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, per_program, BLOCK):
        acc += tl.load(x_ptr + start + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


READ_GRIDS = (2, 4, 8)  # programs per SM tried by `read_floor_ms`
READ_TILE = 4096  # fp16 elements a read program loads per iteration (8 KB)


def read_grid(nbytes: int, max_programs: int) -> tuple[int, int]:
    """(programs, fp16 elements per program) of a plain read of at least `nbytes`: whole tiles,
    as many per program, at most `max_programs`, and no program idle (so the read exceeds
    `nbytes` by less than one program's share)."""
    tiles = -(-nbytes // (2 * READ_TILE))
    per_program = -(-tiles // max_programs)
    return -(-tiles // per_program), per_program * READ_TILE


def read_floor_ms(nbytes: int, device: torch.device) -> tuple[float, int]:
    """(milliseconds per call, programs per SM) of the fastest plain read of `nbytes` (rounded up
    to whole 8 KB tiles, as many per program) over the grids in READ_GRIDS, in the same kind of
    layer-stack graph as attention: what a kernel that only streams the same bytes in, from a
    cold L2, pays per call at this size."""
    sms = _device_info(device)[1]
    best, tried = (math.inf, 0), set()
    for per_sm in READ_GRIDS:
        programs, per_program = read_grid(nbytes, sms * per_sm)
        if programs in tried:
            continue
        tried.add(programs)
        xs = [
            torch.ones(programs * per_program, dtype=torch.float16, device=device)
            for _ in range(num_layers(nbytes))
        ]
        out = torch.empty(programs, dtype=torch.float32, device=device)
        launch = _read_sum[(programs,)]
        calls = [
            functools.partial(launch, x, out, per_program, BLOCK=READ_TILE, num_warps=8) for x in xs
        ]
        best = min(best, (per_call_ms(calls), per_sm))
        del xs
    return best


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a 2 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(2**30, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = _ms(lambda: dst.copy_(src))
    return 2 * src.nbytes / (ms * 1e-3)


def _pool(batch: int, ctx: int, block: int, hkv: int, d: int, dtype, device, table=None):
    """K and V caches of `batch` sequences of `ctx` tokens (stored as the engine stores them)
    and a block table over them: `table`, or a fresh random one. A layer stack passes one table
    to every layer's pool, as the engine's layers share one table per step."""
    per_seq = -(-ctx // block)
    k, v = empty_kv_cache(1, batch * per_seq, block, hkv, d, dtype, device)[0]  # as the engine
    if table is None:
        table = _table(batch, per_seq, False, device)
    return k.normal_(), v.normal_(), table


def _table(batch: int, per_seq: int, identity: bool, device) -> torch.Tensor:
    """A block table: the identity (sequence i owns blocks i * per_seq ...) or a permutation."""
    n = batch * per_seq
    ids = torch.arange(n, device=device) if identity else torch.randperm(n, device=device)
    return ids.view(batch, per_seq).to(torch.int32)


def matmul_rate(dtype, device) -> float:
    a = torch.randn(8192, 8192, dtype=dtype, device=device)
    b = torch.randn_like(a)
    return 2 * 8192**3 / (_ms(lambda: a @ b) * 1e-3)
