"""A bounds check for kernels run by the Triton interpreter.

A GPU faults only when a stray address lands on unmapped memory, so an out-of-bounds read can pass
every test on one machine and kill the CUDA context on another. Under the interpreter every load,
store and atomic of a kernel goes through numpy with real host addresses; `install()` makes each one
check that every address its mask lets through lies inside the storage of one of the kernel's
tensor arguments (the storage, not the view: the GPU's caching allocator hands out whole blocks),
and raise otherwise, naming the kernel. `tests/conftest.py` installs it in every interpreter run.
"""

from __future__ import annotations

import numpy as np
from triton.runtime import interpreter as ti

_ranges: list[tuple[np.ndarray, np.ndarray, str]] = []  # (starts, ends, kernel) of the call running


class OutOfBounds(AssertionError):
    pass


def _check(ptrs: np.ndarray, mask: np.ndarray | None, itemsize: int, what: str) -> None:
    addrs = ptrs if mask is None else ptrs[np.broadcast_to(mask, ptrs.shape)]
    if addrs.size == 0 or not _ranges:
        return
    starts, ends, kernel = _ranges[-1]
    addrs = addrs.astype(np.uint64, copy=False).ravel()
    idx = np.searchsorted(starts, addrs, side="right") - 1
    ok = idx >= 0
    ok[ok] = addrs[ok] + np.uint64(itemsize) <= ends[idx[ok]]
    if not ok.all():
        bad = int(addrs[~ok][0])
        near = min(((abs(bad - int(s)), int(s), int(e)) for s, e in zip(starts, ends, strict=True)))
        raise OutOfBounds(
            f"{kernel}: {what} of {int((~ok).sum())} element(s) outside every argument's storage, "
            f"e.g. address {bad:#x}, {near[0]} bytes from the storage [{near[1]:#x}, {near[2]:#x})"
        )


def install() -> None:
    """Patch the interpreter (idempotent)."""
    if getattr(ti, "_pagedctl_bounds", False):
        return
    ti._pagedctl_bounds = True
    builder = ti.InterpreterBuilder
    init_args, load, store = (
        ti.GridExecutor._init_args_hst,
        builder.create_masked_load,
        builder.create_masked_store,
    )
    rmw, cas = builder.create_atomic_rmw, builder.create_atomic_cas

    def init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        spans = {}
        for arg in [*args_hst, *kwargs_hst.values()]:
            if hasattr(arg, "untyped_storage"):
                storage = arg.untyped_storage()
                spans[storage.data_ptr()] = storage.data_ptr() + storage.nbytes()
        starts = np.array(sorted(spans), dtype=np.uint64)
        ends = np.array([spans[s] for s in sorted(spans)], dtype=np.uint64)
        _ranges[:] = [(starts, ends, getattr(self.fn, "__name__", "kernel"))]
        return args_hst, kwargs_hst

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        itemsize = np.dtype(ti._get_np_dtype(ptrs.get_element_ty())).itemsize
        _check(ptrs.data, mask.data, itemsize, "load")
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    def masked_store(self, ptrs, value, mask, cache_policy):
        _check(ptrs.data, mask.data, value.data.dtype.itemsize, "store")
        return store(self, ptrs, value, mask, cache_policy)

    def atomic_rmw(self, rmw_op, ptr, val, mask, sem, scope):
        _check(ptr.data, mask.data, val.data.dtype.itemsize, "atomic")
        return rmw(self, rmw_op, ptr, val, mask, sem, scope)

    def atomic_cas(self, ptr, cmp, val, sem, scope):
        _check(ptr.data, None, val.data.dtype.itemsize, "atomic_cas")
        return cas(self, ptr, cmp, val, sem, scope)

    ti.GridExecutor._init_args_hst = init_args_hst
    builder.create_masked_load = masked_load
    builder.create_masked_store = masked_store
    builder.create_atomic_rmw = atomic_rmw
    builder.create_atomic_cas = atomic_cas
