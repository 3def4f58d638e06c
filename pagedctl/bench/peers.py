"""The sides of `pagedctl bench`: the engine and its transformers peers, each run on one workload.

Every side gets the same prompt token ids, the same per-request `max_tokens`, the same temperature,
and cannot stop at EOS. Set-up (loading, warm-up, compilation, graph capture) is timed apart from
the measured pass. Each side returns the output tokens every request got, so that the caller can
check them against what was asked; padded batches count only each request's own `max_tokens`.

- pagedctl: `engine.LLM`, one `generate` call over the whole workload.
- hf-generate: transformers `generate`, left-padded batches (default: one batch of everything),
  run to the batch's largest `max_tokens` (`min_new_tokens` too, so EOS cannot end it early).
- hf-static: the same with `cache_implementation="static"`, which transformers compiles on CUDA
  (`torch.compile`, mode reduce-overhead). An untimed pass over the same batch shapes compiles
  first: `warmup_new_tokens` new tokens with the timed pass's cache length (None: the full pass).
- hf-continuous: transformers continuous batching, in `bench_continuous`.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedctl.bench.memory import _rss_bytes, _Sampler
from pagedctl.bench.recipe import BenchRecipe, Workload


@dataclass
class SideRun:
    """What one side did: its configuration, times and the output tokens of each request.

    `counts[i]` is None when request i did not finish (a time limit or an error);
    `computed_tokens` counts every output position computed, padding included. `tokens`: each
    request's output token ids, where the side returns them (compared with pagedctl's, not
    kept); `peak_memory`: {"bytes", "kind"} of a side that measures itself (its own process).
    """

    config: dict[str, Any]
    setup_s: float
    wall_s: float
    counts: list[int | None]
    computed_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)
    tokens: list[list[int] | None] | None = None
    peak_memory: dict[str, Any] | None = None


class MemoryMeter:
    """Peak memory of one side: CUDA allocator peak, or on the CPU the growth of sampled RSS."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind = "cuda max_memory_allocated" if device.type == "cuda" else "RSS growth"

    def __enter__(self) -> MemoryMeter:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base, self.sampler = _rss_bytes(), _Sampler()
            self.sampler.start()
        self.peak = 0
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self.peak = self.sampler.stop() - self.base


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------- pagedctl


def run_pagedctl(recipe: BenchRecipe, wl: Workload, settings: dict) -> SideRun:
    """The engine: `LLM(...)` (not timed), a tiny warm-up, then one timed `generate`."""
    from pagedctl.engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(config=recipe.config)
    llm.capture_graphs()  # every bucket the timed run may meet, outside it
    warm = SamplingParams(temperature=wl.temperature, max_tokens=4, ignore_eos=True)
    llm.generate([list(range(1, 9))] * 2, warm)
    setup = time.perf_counter() - t0
    before = llm.stats["scheduler"]
    params = [
        SamplingParams(temperature=wl.temperature, max_tokens=m, ignore_eos=True)
        for m in wl.max_tokens
    ]
    t0 = time.perf_counter()
    outs = llm.generate(wl.prompts, params)
    wall = time.perf_counter() - t0
    after = llm.stats["scheduler"]
    counts = [len(o.outputs[0].token_ids) if o.ok else None for o in outs]
    sched, kv = llm.scheduler.config, llm.scheduler.kv
    config = {
        "model": llm.model_name,
        "weights": "random (dummy)" if llm.source.load_format == "dummy" else "loaded",
        "device": str(llm.device),
        "dtype": str(llm.dtype).removeprefix("torch."),
        "attention": "paged, Triton kernels" if llm.device.type == "cuda" else "paged, reference",
        "block_size": kv.block_size,
        "num_blocks": kv.num_blocks,
        "kv_pool_tokens": kv.num_blocks * kv.block_size,
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "batching": "continuous, chunked prefill, FCFS preemption by recompute",
    }
    graphs = getattr(llm.runner, "max_graph_batch", 0)
    if graphs:
        config["cuda_graphs_up_to_batch"] = graphs
    extra = {
        "preemptions": after["num_preemptions"] - before["num_preemptions"],
        "recomputed_tokens": after["num_recomputed_tokens"] - before["num_recomputed_tokens"],
        "steps": after["num_steps"] - before["num_steps"],
    }
    tokens = [o.outputs[0].token_ids if o.ok else None for o in outs]
    return SideRun(config, setup, wall, counts, sum(c or 0 for c in counts), extra, tokens)


# ---------------------------------------------------------------------------------- vLLM


def run_vllm(recipe: BenchRecipe, wl: Workload, settings: dict) -> SideRun:
    """vLLM in its own process (`bench.vllm_peer`): loaded and warmed up (not timed), then one
    timed `generate` of the workload. On a CPU its KV pool is pagedctl's default size."""
    from pagedctl.bench.vllm_peer import VLLMProcess
    from pagedctl.engine import default_cpu_kv_bytes, resolve_device, resolve_dtype, resolve_model

    source = resolve_model(recipe.model, recipe.load_format)
    device = resolve_device(recipe.device)
    dtype = str(resolve_dtype(recipe.dtype, device)).removeprefix("torch.")
    longest = max(len(p) + m for p, m in zip(wl.prompts, wl.max_tokens, strict=True))
    kv = recipe.config.kv_cache_memory_bytes
    if kv is None and device.type == "cpu":
        kv = default_cpu_kv_bytes()
    with VLLMProcess(source, dtype, recipe.seed, settings, longest, kv) as peer:
        tokens, wall = peer.generate(wl.prompts, wl.max_tokens, wl.temperature, ignore_eos=True)
    counts = [len(t) for t in tokens]
    return SideRun(
        peer.config, peer.setup_s, wall, counts, sum(counts), tokens=tokens, peak_memory=peer.memory
    )


# ---------------------------------------------------------------------------- transformers


def _hf_model(recipe: BenchRecipe, device: torch.device, dtype: torch.dtype, attn: str):
    """The recipe's model in transformers: its weights if it has them, else random ones."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from pagedctl.engine import resolve_model

    hf_logging.disable_progress_bar()
    source = resolve_model(recipe.model, recipe.load_format)
    torch.manual_seed(recipe.seed)
    if source.weights_dir is None:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                source.hf_config.to_transformers(), dtype=dtype, attn_implementation=attn
            )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            source.weights_dir, dtype=dtype, attn_implementation=attn
        ).to(device)
    model.bench_weights = "random (from_config)" if source.weights_dir is None else "loaded"
    return model.eval()


def sampling_kwargs(temperature: float) -> dict:
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


def hf_config(model, settings: dict, defaults: dict) -> dict:
    cfg = {
        "model": type(model).__name__,
        "weights": model.bench_weights,
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "attention": model.config._attn_implementation,
    }
    return {**cfg, **defaults, **settings}


def _batches(wl: Workload, size: int) -> list[range]:
    n = len(wl.prompts)
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


def left_pad(
    prompts: list[list[int]], width: int, device: torch.device, pad: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids padded on the left to `width`, and the attention mask that hides the padding."""
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


@torch.inference_mode()
def _padded_pass(model, wl: Workload, batch: range, width: int, new: int, extra: dict) -> int:
    """One left-padded `generate` over `batch`, `new` tokens for every row; returns how many
    tokens it added."""
    ids, mask = left_pad([wl.prompts[i] for i in batch], width, model.device)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new,
        min_new_tokens=new,
        pad_token_id=0,
        **sampling_kwargs(wl.temperature),
        **extra,
    )
    return out.shape[1] - width


def _run_padded(model, wl: Workload, settings: dict, static: bool, setup_start: float) -> SideRun:
    size = int(settings.get("batch_size") or len(wl.prompts))
    batches = _batches(wl, size)
    widths = [max(len(wl.prompts[i]) for i in b) for b in batches]
    news = [max(wl.max_tokens[i] for i in b) for b in batches]
    extra: dict = {}
    graphs = _compiled_graphs()
    config: dict = {"batch_size": size, "padding": "left"}
    config["counted"] = "each request's own max_tokens"
    if static:  # one cache shape for every batch, so that one compilation serves them all
        widths = [max(widths)] * len(batches)
        extra = {"cache_implementation": "static", "max_cache_len": widths[0] + max(news)}
        if settings.get("compile") is False:
            extra["disable_compile"] = True
        warm = settings.get("warmup_new_tokens")
        compiled = model.device.type == "cuda" and settings.get("compile") is not False
        config.update(compiled=compiled, warmup_new_tokens=warm or "full pass")
        for b, w, n in zip(batches, widths, news, strict=True):  # the untimed, compiling pass
            _padded_pass(model, wl, b, w, min(n, warm or n), extra)
    else:
        _padded_pass(model, wl, range(min(2, len(wl.prompts))), widths[0], 2, extra)  # warm-up
    _sync(model.device)
    setup = time.perf_counter() - setup_start
    graphs, setup_graphs = _compiled_graphs(), _compiled_graphs() - graphs
    t0 = time.perf_counter()
    counts: list[int | None] = [None] * len(wl.prompts)
    computed = 0
    for b, w, n in zip(batches, widths, news, strict=True):
        got = _padded_pass(model, wl, b, w, n, extra)
        computed += got * len(b)
        for i in b:
            counts[i] = min(got, wl.max_tokens[i])  # its own tokens; the rest is padding
    _sync(model.device)
    wall = time.perf_counter() - t0
    run_extra = {}
    if static:  # the timed pass must not compile: its shapes were all seen in the warm-up
        run_extra = {
            "compiled_graphs_in_setup": setup_graphs,
            "compiled_graphs_in_timed_pass": _compiled_graphs() - graphs,
        }
    return SideRun(config, setup, wall, counts, computed, run_extra)


def _compiled_graphs() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # a private counter: its absence only loses a diagnostic
        return 0


def run_hf_generate(recipe: BenchRecipe, wl: Workload, settings: dict) -> SideRun:
    t0 = time.perf_counter()
    model = hf_peer_model(recipe, settings)
    run = _run_padded(model, wl, settings, static=False, setup_start=t0)
    run.config = hf_config(model, {}, run.config)
    return run


def run_hf_static(recipe: BenchRecipe, wl: Workload, settings: dict) -> SideRun:
    t0 = time.perf_counter()
    model = hf_peer_model(recipe, settings)
    run = _run_padded(model, wl, settings, static=True, setup_start=t0)
    run.config = hf_config(model, {"cache": "static"}, run.config)
    return run


def hf_peer_model(recipe: BenchRecipe, settings: dict):
    from pagedctl.engine import resolve_device, resolve_dtype

    device = resolve_device(recipe.device)
    dtype = resolve_dtype(recipe.dtype, device)
    return _hf_model(recipe, device, dtype, settings.get("attn_implementation", "sdpa"))
