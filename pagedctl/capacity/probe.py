"""Section 5, `--probe`: measure on the GPU what sections 1-2 estimate.

1. Contiguous reservations: beside a stand-in for the weights (an allocation of their size),
   allocate `max_len x bytes_per_token` buffers until CUDA refuses; count them, free them.
2. The engine's own budget: build `engine.llm.LLM` with dummy weights at each memory fraction and
   read its `memory` figures (weights, profiled activation peak, non-KV, KV blocks).

Tensors are touched only here, and torch is imported only when the probe runs.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

REQUIRED_MEMORY_KEYS = (
    "weights_bytes",
    "activation_peak_bytes",
    "non_kv_bytes",
    "kv_cache_bytes",
    "num_blocks",
    "block_size",
    "total_bytes",
    "utilization",
)


class ProbeError(RuntimeError):
    """The probe cannot run here (no CUDA, or an engine that does not report its memory)."""


def probe_contiguous(reservation_bytes: int, weights_bytes: int, device: str = "cuda") -> dict:
    """Count max-length reservations that fit beside the weights, then free everything."""
    import torch

    if not torch.cuda.is_available():
        raise ProbeError("--probe needs a CUDA device; this machine has none")
    dev = torch.device(device)
    torch.cuda.empty_cache()
    props = torch.cuda.get_device_properties(dev)
    weights = torch.empty(weights_bytes, dtype=torch.uint8, device=dev)
    free, total = torch.cuda.mem_get_info(dev)
    outside_torch = total - free - torch.cuda.memory_reserved(dev)  # context, other processes
    held = []
    try:
        while True:
            held.append(torch.empty(reservation_bytes, dtype=torch.uint8, device=dev))
    except torch.cuda.OutOfMemoryError:
        pass
    count = len(held)
    left, _ = torch.cuda.mem_get_info(dev)
    del held, weights
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "device_name": props.name,
        "total_bytes": int(total),
        "weights_stand_in_bytes": weights_bytes,
        "outside_torch_bytes": int(outside_torch),
        "reservation_bytes": reservation_bytes,
        "reservations": count,
        "left_free_bytes": int(left),
    }


def probe_engine(
    model: str,
    gpu_mems: list[float],
    block_size: int,
    dtype: str,
    max_len: int,
    make_llm: Callable | None = None,
    cuda_graphs: bool = True,
) -> list[dict]:
    """`LLM(...).memory` at each memory fraction (one model load, `reconfigure` for the rest),
    with or without step graphs, as the estimate counts them."""
    if make_llm is None:
        from pagedctl.engine import LLM as make_llm
    llm = make_llm(
        model,
        load_format="dummy",
        device="cuda",
        dtype=dtype,
        gpu_memory_utilization=gpu_mems[0],
        block_size=block_size,
        max_model_len=max_len,
        cuda_graphs=cuda_graphs,
    )
    rows = [_memory_of(llm)]
    for g in gpu_mems[1:]:
        if hasattr(llm, "reconfigure"):
            llm.reconfigure(gpu_memory_utilization=g)
        else:
            del llm
            _release()
            llm = make_llm(
                model,
                load_format="dummy",
                device="cuda",
                dtype=dtype,
                gpu_memory_utilization=g,
                block_size=block_size,
                max_model_len=max_len,
                cuda_graphs=cuda_graphs,
            )
        rows.append(_memory_of(llm))
    del llm
    _release()
    return rows


def _memory_of(llm) -> dict:
    if hasattr(llm, "capture_graphs"):  # the graphs' pool counts as a running engine's would
        llm.capture_graphs()
    memory = getattr(llm, "memory", None)
    if not isinstance(memory, dict):
        raise ProbeError("this engine.LLM does not report `memory`; update pagedctl")
    missing = [k for k in REQUIRED_MEMORY_KEYS if memory.get(k) is None]
    if missing:
        raise ProbeError(f"engine.LLM.memory lacks {missing}")
    return dict(memory)


def _release() -> None:
    gc.collect()
    try:
        import torch

        torch.cuda.empty_cache()
    except (ImportError, RuntimeError):
        pass


def probe_rows(estimate: dict, contiguous: dict | None, engine: list[dict]) -> list[dict]:
    """Measured figures beside the estimates of sections 1-2.

    `estimate` holds `total_bytes`, `contiguous_whole_card`, `cuda_context_bytes`,
    `weights_bytes`, `activation_peak_bytes`, `graph_reserve_bytes` (optional), `non_kv_bytes`
    and `pools`: {fraction: blocks}.
    """
    rows: list[dict] = []

    def add(what: str, est, measured, unit: str) -> None:
        diff = None
        if isinstance(est, int | float) and isinstance(measured, int | float) and est:
            diff = f"{100 * (measured - est) / est:+.1f}%"
        rows.append(
            {
                "what": what,
                "estimate": _show(est, unit),
                "measured": _show(measured, unit),
                "diff": diff or "-",
                "estimate_value": est,
                "measured_value": measured,
            }
        )

    if contiguous is not None:
        add("device memory", estimate["total_bytes"], contiguous["total_bytes"], "bytes")
        add(
            "CUDA context and other processes",
            estimate["cuda_context_bytes"],
            contiguous["outside_torch_bytes"],
            "bytes",
        )
        add(
            "contiguous max-len reservations, whole card",
            estimate["contiguous_whole_card"],
            contiguous["reservations"],
            "count",
        )
    for mem in engine:
        g = mem["utilization"]
        add(f"weights @{g:g}", estimate["weights_bytes"], mem["weights_bytes"], "bytes")
        add(
            f"activation peak @{g:g}",
            estimate["activation_peak_bytes"],
            mem["activation_peak_bytes"],
            "bytes",
        )
        if "cuda_graph_reserve_bytes" in mem:
            add(
                f"CUDA-graph reserve @{g:g}",
                estimate.get("graph_reserve_bytes"),
                mem["cuda_graph_reserve_bytes"],
                "bytes",
            )
        add(f"non-KV memory @{g:g}", estimate["non_kv_bytes"], mem["non_kv_bytes"], "bytes")
        add(
            f"KV blocks of {mem['block_size']} @{g:g}",
            estimate["pools"].get(g),
            mem["num_blocks"],
            "count",
        )
        if mem.get("cuda_graph_bytes"):
            add(f"CUDA graphs @{g:g} (outside the budget)", None, mem["cuda_graph_bytes"], "bytes")
    return rows


def _show(v, unit: str) -> str:
    from pagedctl.engine import format_bytes

    if v is None:
        return "-"
    return format_bytes(v) if unit == "bytes" else f"{int(v):,}"
