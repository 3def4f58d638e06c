"""Flags and recipe values of `pagedctl capacity`, checked: the model, the plan inputs, lengths.

Every problem is one clear error (exit status 2), never a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console

from pagedctl.capacity import plan
from pagedctl.capacity.card import CardError, resolve_card
from pagedctl.capacity.lengths import Lengths, LengthsError, from_distribution, from_jobs
from pagedctl.capacity.model import ModelFootprint, ModelSpecError, dtype_bytes, resolve_footprint
from pagedctl.capacity.recipe import as_list
from pagedctl.engine import parse_bytes
from pagedctl.exits import EXIT_USAGE


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    Console(stderr=True).print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def floats(value: Any, what: str, low: float, high: float) -> tuple[float, ...]:
    try:
        out = tuple(float(v) for v in as_list(value))
    except (TypeError, ValueError):
        raise typer.BadParameter(f"{what}: expected numbers, got {value!r}") from None
    if not out or not all(low < v <= high for v in out):
        raise typer.BadParameter(
            f"{what}: every value must be in ({low:g}, {high:g}], got {value!r}"
        )
    return out


def ints(value: Any, what: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in as_list(value))
    except (TypeError, ValueError):
        raise typer.BadParameter(f"{what}: expected integers, got {value!r}") from None
    if not out or min(out) < 1:
        raise typer.BadParameter(f"{what}: expected positive integers, got {value!r}")
    return out


def bytes_or_none(value: Any, what: str) -> int | None:
    if value is None:
        return None
    try:
        return parse_bytes(value)
    except ValueError as e:
        raise typer.BadParameter(f"{what}: {e}") from None


def resolve_model(s: dict) -> tuple[ModelFootprint, str, int]:
    """The model's footprint and the run's (dtype name, bytes per element)."""
    if not s.get("model"):
        fail("name a model: --model FOLDER | CONFIG.json | PRESET (see pagedctl models list)")
    try:
        fp = resolve_footprint(str(s["model"]))
        return (fp, *dtype_bytes(str(s["dtype"]), fp.config))
    except ModelSpecError as e:
        fail(str(e))


def plan_inputs(s: dict, fp: ModelFootprint, dtype: str, nbytes: int) -> plan.PlanInputs:
    """Card, fractions, block sizes, lengths limit and budgets, checked."""
    num_blocks = int(s["num_blocks"]) if s.get("num_blocks") is not None else None
    try:
        card = resolve_card(s.get("device_memory"), s.get("gpu"))
    except CardError as e:
        if num_blocks is None:
            fail(str(e))
        card = None
    max_len = int(s.get("max_len") or fp.max_positions)
    if max_len < 1:
        raise typer.BadParameter(f"--max-len must be positive, got {max_len}")
    if max_len > fp.max_positions:  # the engine refuses such a max_model_len too
        raise typer.BadParameter(
            f"--max-len {max_len} exceeds the model's {fp.max_positions} positions "
            "(max_position_embeddings)"
        )
    return plan.PlanInputs(
        footprint=fp,
        dtype=dtype,
        dtype_bytes=nbytes,
        quantization=quantization_of(s, fp, nbytes, card),
        card=card,
        gpu_mems=floats(s["gpu_mem"], "--gpu-mem", 0.0, 1.0),
        block_sizes=ints(s["block_size"], "--block-size"),
        max_len=max_len,
        non_kv_bytes=bytes_or_none(s.get("non_kv_memory"), "--non-kv-memory"),
        num_blocks=num_blocks,
        cuda_context_bytes=bytes_or_none(s["cuda_context"], "--cuda-context") or 0,
        shared_prefix=int(s.get("shared_prefix") or 0),
        cuda_graphs=_flag(s.get("cuda_graphs", True), "cuda_graphs"),
        swap_space_bytes=_gib(s.get("swap_space"), "--swap-space"),
    )


def quantization_of(s: dict, fp: ModelFootprint, nbytes: int, card: Any) -> str:
    """How the engine would load the weights under `--quantization` on this card: the
    engine's own choice (`engine.choose_quantization`), `auto` weighing the float weights
    against the card's memory as the engine does on CUDA."""
    import torch

    from pagedctl.engine import ConfigError, choose_quantization, float_budget

    setting = str(s.get("quantization") or "auto")
    try:
        own = fp.own_quantization()
        floats = fp.weights_bytes(nbytes)
        card_bytes = None if card is None else float_budget(torch.device("cuda"), card.total_bytes)
        return choose_quantization(setting, own, f"{fp.name} is already quantized ({own})",
                                   floats, card_bytes)  # fmt: skip
    except (ConfigError, ValueError) as e:
        fail(f"--quantization: {e}")


def _gib(value: Any, what: str) -> int | None:
    """A size in GiB (a number >= 0, as the engine's --swap-space takes it) as bytes."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise typer.BadParameter(f"{what}: expected a number of GiB >= 0, got {value!r}")
    return int(value * 2**30)


def _flag(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    raise typer.BadParameter(f"{what}: expected true or false, got {value!r}")


def lengths_of(s: dict, fp: ModelFootprint, max_len: int) -> Lengths | None:
    """`--lengths` (and `--outputs`) or `--dist`; None when neither is given."""
    if s.get("lengths") and s.get("dist"):
        fail("give --lengths or --dist, not both")
    if s.get("outputs") and not s.get("lengths"):
        fail("--outputs needs --lengths (the input file of that generate run)")
    try:
        if s.get("lengths"):
            out = Path(s["outputs"]) if s.get("outputs") else None
            return from_jobs(Path(s["lengths"]), max_len, fp.tokenizer_dir, out)
        if s.get("dist"):
            return from_distribution(str(s["dist"]), max_len)
    except LengthsError as e:
        fail(str(e))
    return None
