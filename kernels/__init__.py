"""Attention, KV-write, fused elementwise and sampling ops, one signature each: Triton or PyTorch
reference.

Dispatch per call: the Triton kernels when the tensors are on CUDA, the reference otherwise.
Environment variable `PAGEDCTL_KERNELS=triton` forces the kernels (e.g. on the CPU under
`TRITON_INTERPRET=1`, which must be set before the first call), `PAGEDCTL_KERNELS=reference`
forces the reference. Callers never import a backend module directly. The projections' matmul is
torch's own, except in bfloat16 on the CPU (`pack_linear_weight`, `packed_linear`: oneDNN with
each weight packed once, `kernels.onednn`).

`paged_attention` reads its batch (block tables, lengths, query offsets) as one `PagedBatch`,
the type each implementation takes and the engine's per-step metadata holds.

Batch-invariant ops (`batch_invariant=True` of `paged_attention` and `silu_and_mul`,
`invariant_linear`): a row's result does not depend on the other rows of the call, for the
engine's `deterministic` setting: `kernels.batch_invariant` on the CPU, the Triton attention with
one config and no split-KV and `kernels.triton_matmul` where the Triton kernels serve;
`batch_invariant_serves` says where the engine may use them.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.machinery import ModuleSpec, PathFinder

_HERE = os.path.dirname(os.path.realpath(__file__))


def _other_kernels() -> ModuleSpec:
    """The `kernels` package that `import kernels` would find if this folder were not there
    (Hugging Face's, which transformers imports), or ModuleNotFoundError as Python would raise.

    NOTE: this folder installs as `pagedctl.kernels`. It is imported as the top-level `kernels`
    only by mistake, from a checkout whose root is on `sys.path` (pytest, `python -c` or
    `python -m` run there). Then it stands aside: with no other `kernels` it raises here, before
    anything of its own is imported; else it runs and hands the name over (`_hand_over`)."""
    root = os.path.dirname(_HERE)
    path = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
    spec = PathFinder.find_spec("kernels", path)
    if spec is None:
        raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
    return spec


if __name__ == "kernels":
    _OTHER = _other_kernels()

import torch  # noqa: E402  (after the check above: a mistaken import stops before torch)
from torch import Tensor  # noqa: E402

from . import reference  # noqa: E402
from .paged_batch import PagedBatch  # noqa: E402
from .quant import QuantizedWeight  # noqa: E402

_NO_TRITON = (
    "the Triton kernels serve this call ({why}) and need the `triton` package, which is not "
    "installed (torch's CUDA builds bring it); install it, or set PAGEDCTL_KERNELS=reference to "
    "run the PyTorch reference ops"
)


def _use_triton(tensor: Tensor) -> bool:
    """Whether this call goes to the Triton kernels (imported lazily: Triton is optional)."""
    forced = _forced_backend()
    return forced == "triton" if forced else tensor.is_cuda


def _triton_serves(device: torch.device) -> bool:
    """Whether calls on tensors of this device go to the Triton kernels."""
    forced = _forced_backend()
    return forced == "triton" if forced else device.type == "cuda"


@contextmanager
def _needs_triton() -> Iterator[None]:
    """Around the import of a Triton module: a missing `triton` says what to do about it.

    Triton is not a dependency of the package; the `triton_*` modules are imported on the first
    call that goes to them, so a CPU-only install never imports Triton."""
    try:
        yield
    except ModuleNotFoundError as e:
        if e.name != "triton" and not (e.name or "").startswith("triton."):
            raise
        why = "PAGEDCTL_KERNELS=triton" if _forced_backend() == "triton" else "CUDA tensors"
        raise ModuleNotFoundError(_NO_TRITON.format(why=why), name=e.name) from e


def _forced_backend() -> str | None:
    """The backend `PAGEDCTL_KERNELS` forces ("triton" or "reference"), else None."""
    forced = os.environ.get("PAGEDCTL_KERNELS", "").lower()
    return forced if forced in ("reference", "triton") else None


class JitClock:
    """Time spent in Triton's JIT (a kernel compiled, or loaded from Triton's disk cache) while
    entered; a context manager that may be entered again and nested. Disabled, or without
    Triton installed, it counts nothing and imports nothing."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.count = 0  # variants compiled or loaded (one per set of compile-time constants)
        self.by_kernel: dict[str, float] = {}  # kernel name -> seconds, over its variants
        self._depth = 0
        self._saved: tuple = ()
        self._started: list[float] = []

    @property
    def seconds(self) -> float:
        return sum(self.by_kernel.values())

    def __enter__(self) -> JitClock:
        self._depth += 1
        if self._depth == 1 and self.enabled:
            self._install()
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0 and self._saved:
            knobs = self._saved[0]
            knobs.jit_cache_hook, knobs.jit_post_compile_hook = self._saved[1:]
            self._saved = ()

    def _install(self) -> None:
        try:
            from triton import knobs
        except ImportError:
            return
        runtime = knobs.runtime
        before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
        self._saved = (runtime, before, after)

        def on_miss(**kwargs):
            self._started.append(time.perf_counter())
            return before(**kwargs) if before else False

        def on_compiled(**kwargs):
            if self._started:
                took = time.perf_counter() - self._started.pop()
                self.count += 1
                name = getattr(kwargs.get("fn"), "name", "?")
                self.by_kernel[name] = self.by_kernel.get(name, 0.0) + took
            return after(**kwargs) if after else False

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_miss, on_compiled


def graph_capturable(device_type: str) -> bool:
    """Whether the ops on this device can be captured in a CUDA graph: the Triton kernels can;
    the reference reads tensor values on the host (lengths, offsets) and cannot."""
    return device_type == "cuda" and _forced_backend() != "reference"


def empty_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> Tensor:
    """Uninitialised K and V of every layer, seen as `[layers, 2, num_blocks, block_size,
    num_kv_heads, head_dim]` (the layout every op takes: `[..., block, token, head, dim]`).

    Where the Triton kernels serve the device, the storage is head-major inside a block
    (`[..., block, head, token, dim]`, returned as a permuted view): an attention program reads
    its KV head's part of a block as one contiguous run of `block_size * head_dim` elements
    instead of `head_dim` elements every `num_kv_heads * head_dim`. On an H200 that is 0-3%
    faster on every decode shape timed. The reference ops keep token-major storage: their gathers
    flatten (block, token) into slots, which a permuted view would copy.
    """
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    if not _triton_serves(torch.device(device)):
        return torch.empty(shape, dtype=dtype, device=device)
    stored = torch.empty(
        (num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim), dtype=dtype, device=device
    )
    return stored.transpose(3, 4)


def write_kv(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Store new K/V rows at their cache slots; contract in `kernels.reference.write_kv`."""
    if _use_triton(k_cache):
        with _needs_triton():
            from .triton_kv import write_kv as triton_write_kv

        triton_write_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    reference.write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    batch: PagedBatch,
    softmax_scale: float,
    *,
    plan_cache: dict | None = None,
    num_splits: int | None = None,
    batch_invariant: bool = False,
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Causal varlen attention of `q`'s rows over the paged cache, as `batch` describes them;
    contract in `kernels.reference`.

    `window`: sliding-window attention (Mistral, Gemma's local layers) as Hugging Face has it:
    a query at position `p` sees the keys at `p - window < k <= p`; None: every key up to `p`.
    The blocks of a sequence whose positions all lie at or below `p0 - window` (`p0`: its first
    query's position in this call) are never read and cannot touch the result, whatever their
    table entries hold: the engine may free them. `softcap`: logit soft-capping (Gemma 2):
    scores `s = (q . k) * softmax_scale` become `softcap * tanh(s / softcap)` before the masks
    and the softmax; None: off. Both None: the causal attention as without them, bit for bit.

    `plan_cache`: a dict living for one forward pass that an op may memoise per-step work in
    (the reference's gather indices); the Triton kernels need none. `num_splits`: how many
    programs share each query block's history (split-KV; None: the kernel's choice); a
    performance hint that leaves the result unchanged (the reference ignores it).
    `batch_invariant`: each row's bits depend on its own sequence alone (`kernels.batch_invariant`;
    where `batch_invariant_serves`).
    """
    args = (q, k_cache, v_cache, batch, softmax_scale)
    options = dict(window=window, softcap=softcap)
    if _use_triton(q):
        with _needs_triton():
            from .triton_attention import paged_attention as triton_paged_attention

        return triton_paged_attention(
            *args, num_splits=num_splits, batch_invariant=batch_invariant, **options
        )
    if batch_invariant:
        from . import batch_invariant as invariant

        return invariant.paged_attention(*args, plan_cache=plan_cache, **options)
    return reference.paged_attention(*args, plan_cache=plan_cache, **options)


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm of `x` (or of `x + residual`, also returned); contract in `kernels.reference`."""
    if _use_triton(x):
        with _needs_triton():
            from .triton_fused import rms_norm as triton_rms_norm

        return triton_rms_norm(x, weight, eps, residual)
    return reference.rms_norm(x, weight, eps, residual)


def batch_invariant_serves(device: torch.device) -> bool:
    """Whether the engine may run its `deterministic` setting on this device: the CPU (its own
    ops, or the Triton kernels under the interpreter) and CUDA devices where the Triton kernels
    serve (tests/test_deterministic_gpu.py checks a row's bits there alone and in any batch).
    Not CUDA with `PAGEDCTL_KERNELS=reference`: torch's CUDA matmuls pick their split of the
    reduction by the shape of the batch."""
    return device.type == "cpu" or (device.type == "cuda" and _triton_serves(device))


def invariant_linear(
    x: Tensor, weight: Tensor, packed: Tensor | None = None, bias: Tensor | None = None
) -> Tensor:
    """`F.linear(x, weight, bias)` whose rows' bits do not depend on the other rows of `x`
    (`packed`: `pack_linear_weight(weight)` or None): `kernels.triton_matmul.linear` where the
    Triton kernels serve, else `kernels.batch_invariant.linear`."""
    if _use_triton(x):
        with _needs_triton():
            from .triton_matmul import linear as triton_linear

        return triton_linear(x, weight, bias)
    from . import batch_invariant as invariant

    return invariant.linear(x, weight, packed, bias)


def pack_linear_weight(weight: Tensor) -> Tensor | None:
    """A copy of a linear layer's weight `[out, in]` packed for `packed_linear`, where that is
    faster than `F.linear` and gives its bits (bfloat16 on the CPU, `kernels.onednn`); else
    None."""
    from . import onednn

    return onednn.pack(weight) if onednn.packs(weight) else None


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` through `pack_linear_weight(weight)`."""
    from . import onednn

    return onednn.linear(x, packed, bias)


def prepare_quantized(weight: QuantizedWeight) -> object:
    """The form of a quantized weight (`kernels.quant`) that `quantized_linear` runs on the
    weight's device, made once at load: `kernels.triton_quant`'s where the Triton kernels serve,
    torch's CPU int4 layout for a 4-bit weight it takes (`kernels.quant_cpu`), else the weight
    itself (dequantized a tile at a time per call)."""
    if _triton_serves(weight.qdata.device):
        with _needs_triton():
            from . import triton_quant

        return triton_quant.prepare(weight)
    from . import quant_cpu

    if weight.qdata.device.type == "cpu" and quant_cpu.int4_packs(weight):
        return quant_cpu.pack_int4(weight)
    return weight


def quantized_linear(
    x: Tensor, weight: object, bias: Tensor | None = None, batch_invariant: bool = False
) -> Tensor:
    """`x @ w.T (+ bias)` of a weight made by `prepare_quantized`, in x's dtype; with
    `batch_invariant`, a row's bits depend on that row alone (torch's CPU int4 matmul is one
    row at a time; `tests/test_quant_kernels.py` checks it)."""
    from . import quant_cpu

    if isinstance(weight, QuantizedWeight):
        return quant_cpu.tiled_linear(x, weight, bias, invariant=batch_invariant)
    if isinstance(weight, quant_cpu.Int4Packed):
        return quant_cpu.int4_linear(x, weight, bias)
    with _needs_triton():
        from . import triton_quant

    return triton_quant.linear(x, weight, bias, batch_invariant=batch_invariant)


def quantized_embedding(ids: Tensor, weight: QuantizedWeight, dtype: torch.dtype) -> Tensor:
    """The rows `ids` of a quantized embedding table, dequantized into `dtype`."""
    from .quant import dequantize

    return dequantize(weight.rows(ids), dtype)


def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Tensor) -> None:
    """Neox rotary embedding in place on q and k; contract in `kernels.reference.rotary`."""
    if _use_triton(q):
        with _needs_triton():
            from .triton_fused import rotary as triton_rotary

        triton_rotary(q, k, cos, sin, positions)
        return
    reference.rotary(q, k, cos, sin, positions)


def rotary_write_kv(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
) -> None:
    """Rotary on q and k in place and the new K/V rows into the cache, one launch on the GPU;
    contract in `kernels.reference.rotary_write_kv`."""
    args = (q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping)
    if _use_triton(q):
        with _needs_triton():
            from .triton_fused import rotary_write_kv as triton_rotary_write_kv

        triton_rotary_write_kv(*args)
        return
    reference.rotary_write_kv(*args)


def silu_and_mul(x: Tensor, batch_invariant: bool = False) -> Tensor:
    """`silu(gate) * up` of a fused `[T, 2I]` gate/up output; contract in `kernels.reference`.
    `batch_invariant`: each row's bits depend on that row alone (the Triton kernel's always do;
    on the CPU, `kernels.batch_invariant.silu_and_mul`)."""
    if _use_triton(x):
        with _needs_triton():
            from .triton_fused import silu_and_mul as triton_silu_and_mul

        return triton_silu_and_mul(x)
    if batch_invariant:
        from . import batch_invariant as invariant

        return invariant.silu_and_mul(x)
    return reference.silu_and_mul(x)


def sample_temperature(logits: Tensor, temperature: float, u: Tensor) -> Tensor:
    """Temperature sampling by inverse CDF, one uniform per row; contract in `kernels.reference`."""
    if _use_triton(logits):
        with _needs_triton():
            from .triton_sample import (
                sample_temperature as triton_sample_temperature,
            )

        return triton_sample_temperature(logits, temperature, u)
    return reference.sample_temperature(logits, temperature, u)


def apply_penalties(
    logits: Tensor,
    rows: Tensor,
    pool: Tensor,
    counts: Tensor,
    prompt: Tensor,
    repetition: Tensor,
    frequency: Tensor,
    presence: Tensor,
) -> None:
    """Repetition, frequency and presence penalties in place on float32 logits rows, from
    per-sequence output counts and prompt masks; contract in `kernels.reference`."""
    args = (logits, rows, pool, counts, prompt, repetition, frequency, presence)
    if _use_triton(logits):
        with _needs_triton():
            from .triton_sample import apply_penalties as triton_apply_penalties

        return triton_apply_penalties(*args)
    return reference.apply_penalties(*args)


__all__ = [
    "JitClock",
    "PagedBatch",
    "QuantizedWeight",
    "apply_penalties",
    "batch_invariant_serves",
    "empty_kv_cache",
    "graph_capturable",
    "invariant_linear",
    "pack_linear_weight",
    "packed_linear",
    "paged_attention",
    "prepare_quantized",
    "quantized_embedding",
    "quantized_linear",
    "rms_norm",
    "rotary",
    "rotary_write_kv",
    "sample_temperature",
    "silu_and_mul",
    "write_kv",
]


def _hand_over(spec: ModuleSpec) -> None:
    """Run the other `kernels` under the name in place of this module, which is dropped with
    its submodules: the import that found this folder by mistake gets the package it wanted.

    (Importing a module returns what `sys.modules` holds under its name once the module has run.)
    """
    import importlib.util

    for name, module in list(sys.modules.items()):
        where = os.path.realpath(getattr(module, "__file__", None) or os.sep)
        if name.startswith("kernels.") and os.path.dirname(where) == _HERE:
            del sys.modules[name]
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    if spec.loader is not None:
        spec.loader.exec_module(module)


if __name__ == "kernels":
    _hand_over(_OTHER)
