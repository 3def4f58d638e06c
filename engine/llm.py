"""`LLM`: the engine's public entry point — load a model, size the KV cache, run requests."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import asdict
from typing import Any

import torch

from .core.beam_search import BeamSearchParams
from .core.config import (
    NAMES,
    SETTINGS,
    CacheConfig,
    ConfigError,
    EngineConfig,
    SchedulerConfig,
    default_step_limits,
)
from .core.sampling_params import SamplingParams
from .core.scheduler import Scheduler, SchedulerOutput
from .core.sequence import Sequence, SequenceStatus
from .core.swap import host_blocks
from .core.units import format_bytes
from .cpu_threads import apply_threads, watch_threads
from .models.quantization import plan_quantization, weight_stream
from .models.registry import build_model
from .models.source import resolve_model
from .models.weights import load_tokenizer
from .outputs import RequestOutput
from .requests import PromptInput, RequestTracker
from .runner.containment import execute_contained
from .runner.model_runner import ModelRunner, StepResult
from .runner.startup import StartupClock, use_compile_cache
from .sizing.device import check_deterministic, resolve_device, resolve_dtype
from .sizing.kv import KVLayout, max_concurrency
from .sizing.pool import (
    check_max_model_len,
    kv_cache_blocks,
    model_max_len,
    resolve_max_model_len,
)
from .sizing.profiling import calibrate_preemption

logger = logging.getLogger("pagedctl.engine")

Params = SamplingParams | BeamSearchParams
ParamsArg = Params | Seq[Params] | None


def _device_total(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).total_memory


class LLM:
    """Offline generation on the paged engine.

    Args:
        model: a local Hugging Face folder, a GGUF file, a preset name (dummy weights) or a model
            id in the local Hugging Face cache (`pagedctl.bundled_model()` gives the bundled
            SmolLM2-135M-Instruct's folder).
        config: settings to start from (default: `EngineConfig()`).
        **settings: any field of `EngineConfig`, by its name or an alias (`block_size=32`,
            `gpu_memory_utilization=0.8`, `num_scheduler_steps=1`, ...); checked before anything
            is loaded.

    After construction, `config` holds the settings and `memory` the sizing figures (bytes):
    `weights_bytes`, `kv_cache_bytes`, `num_blocks`, `block_size`, and on CUDA `total_bytes`,
    `utilization`, `activation_peak_bytes`, `non_kv_bytes` (weights + activation peak; absent
    when the pool size was given) and `cuda_graph_bytes` (the pool of the step graphs captured
    so far).
    """

    replicas = None  # one process: no replica table (see `engine.protocol.Engine`)

    def __init__(
        self, model: str | None = None, *, config: EngineConfig | None = None, **settings: Any
    ) -> None:
        given = {"model": model, **settings} if model is not None else settings
        config = (config or EngineConfig()).replace(**given)
        if config.model is None:
            raise ConfigError("no model: name a model folder, .gguf file, preset or cached id")
        self.device = resolve_device(config.device)
        check_deterministic(config, self.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.seed = config.seed
        self._clock = StartupClock(self.device.type)
        if self.device.type == "cuda":
            use_compile_cache()
        with self._clock.phase("load"):
            self.source = resolve_model(config.model, config.load_format)
            self.model_name = config.served_model_name or self.source.name
            self.hf_config = self.source.hf_config
            check_max_model_len(config.max_model_len, self.hf_config)
            self.quantization = plan_quantization(
                self.source, config.quantization, self.device, self.dtype
            )
            quantized = self.quantization.quantized
            self.model = build_model(self.hf_config, self.dtype, self.device, quantized)
            if self.source.load_format == "dummy" and not quantized:
                self.model.init_dummy_weights(config.seed)
            else:
                plan, source = self.quantization, self.source
                self.model.load_weights(weight_stream(plan, source, self.model, config.seed))
            self.model.eval()
            self.model.pack_weights()
            self.tokenizer = load_tokenizer(self.source) if self.source.tokenizer_dir else None
        self.layout = KVLayout(
            self.model.num_layers,
            self.model.num_kv_heads,
            self.model.head_dim,
            self.dtype.itemsize,
        )
        self.tracker = RequestTracker(self.tokenizer, self.model.vocab_size, self._eos_ids())
        self.runner: ModelRunner | None = None
        self.config = config
        self._build_engine(config)

    # ------------------------------------------------------------------ set-up

    def reconfigure(self, **settings: Any) -> None:
        """Rebuild the KV pool, scheduler and runner with new settings; the weights stay loaded.

        Takes the `EngineConfig` fields that need no new model (`block_size`,
        `gpu_memory_utilization`, `num_gpu_blocks_override`, ...); those not given keep their
        current value. Nothing may be in flight. `pagedctl sweep` tries many pools on one
        loaded model this way.
        """
        config = self.config.replace(**settings)
        check_deterministic(config, self.device)
        check_max_model_len(config.max_model_len, self.hf_config)
        reload = [
            n for n in NAMES if SETTINGS[n].load and getattr(config, n) != getattr(self.config, n)
        ]
        if reload:
            raise ConfigError(f"{', '.join(reload)} cannot change without a new LLM")
        if self.runner is not None and self.scheduler.has_unfinished():
            raise RuntimeError("reconfigure() with requests in flight; finish or abort them first")
        self._clock = StartupClock(self.device.type, since_process_start=False)
        self._build_engine(config)

    def _build_engine(self, c: EngineConfig) -> None:
        """Size the pool for settings `c`, then build the scheduler and the runner on it."""
        self._release_engine()
        self.model.set_batch_invariant(c.deterministic)
        self.model.fit_max_model_len(c.max_model_len or model_max_len(self.hf_config))
        apply_threads(c.num_threads, self.device.type)
        self._threads = watch_threads(c.num_threads, self.device.type)
        limits, cache = self._size_pool(c)
        clock = self._clock
        with clock.phase("pool"):
            self.scheduler = Scheduler(limits, cache)
        with clock.phase("capture"):
            self.runner = ModelRunner(
                self.model,
                cache=cache,
                limits=limits,
                device=self.device,
                kv_dtype=self.dtype,
                seed=self.seed,
                cuda_graphs=c.cuda_graphs,
                clock=clock,
            )
        if c.preemption_mode == "auto" and cache.num_host_blocks >= 2 and cache.num_blocks >= 2:
            with clock.phase("calibrate"):
                runner = self.runner
                self.scheduler.costs = calibrate_preemption(
                    self.model, runner.kv_caches, runner.host_kv, cache.block_size, self.device,
                    limits.max_num_batched_tokens,
                )  # fmt: skip
        self.config = c
        self._log_start(cache.num_blocks, cache.block_size)

    def _size_pool(self, c: EngineConfig) -> tuple[SchedulerConfig, CacheConfig]:
        """The step limits and the pool's shape for settings `c` on this device (profiled on
        CUDA), and the sizing figures of `memory`."""
        weights = self.model.weights_bytes()
        self._sizing: dict = {"weights_bytes": weights, "utilization": None}
        total = _device_total(self.device) if self.device.type == "cuda" else 0
        if total:
            self._sizing["total_bytes"] = total
        default_tokens, default_seqs = default_step_limits(self.device.type, total)
        max_num_seqs = c.max_num_seqs or default_seqs
        batched = c.max_num_batched_tokens or default_tokens
        config_len = model_max_len(self.hf_config)
        with self._clock.phase("profile"):
            blocks, figures = kv_cache_blocks(
                self.model,
                self.layout,
                self.device,
                self.dtype,
                c.block_size,
                num_blocks=c.num_gpu_blocks_override,
                kv_cache_memory=c.kv_cache_memory_bytes,
                utilization=c.gpu_memory_utilization,
                useful_tokens=max_num_seqs * (c.max_model_len or config_len),
                batched_tokens=batched,
                max_num_seqs=max_num_seqs,
                weights_bytes=weights,
                reserve_graphs=bool(c.cuda_graphs),
            )
        self._sizing.update(figures)
        self.max_model_len = resolve_max_model_len(
            c.max_model_len, config_len, blocks * c.block_size
        )
        block_bytes = self.layout.bytes_per_block(c.block_size)
        host = 0
        if c.preemption_mode != "recompute":
            host = host_blocks(int(c.swap_space * 2**30), block_bytes)
        self._sizing["kv_cache_bytes"] = blocks * block_bytes
        self._sizing.update(num_blocks=blocks, block_size=c.block_size, num_host_blocks=host)
        self._sizing["swap_space_bytes"] = host * block_bytes
        limits = SchedulerConfig(
            max_num_batched_tokens=batched,
            max_num_seqs=max_num_seqs,
            max_model_len=self.max_model_len,
            debug=c.debug,
            preemption_mode=c.preemption_mode,
        )
        cache = CacheConfig(
            block_size=c.block_size,
            num_blocks=blocks,
            enable_prefix_caching=c.enable_prefix_caching,
            hash_seed=self.seed,
            num_host_blocks=host,
            sliding_window=self.model.spec.kv_window,
        )
        return limits, cache

    def capture_graphs(self) -> int:
        """Capture every CUDA step graph now; returns how many there are. Graphs are otherwise
        captured when a step first needs one (a small job captures only the few it uses), so
        a benchmark calls this before its timed run. No-op without graphs."""
        graphs = self.runner.graphs
        if graphs is None:
            return 0
        graphs.capture_all()  # counted in the start-up clock's capture phase
        return graphs.num_captured

    @property
    def memory(self) -> dict:
        """The sizing figures (see the class docstring), the step graphs' pool as it is now."""
        if self.device.type != "cuda":
            return dict(self._sizing)
        graphs = self.runner.graph_pool_bytes if self.runner is not None else 0
        return {**self._sizing, "cuda_graph_bytes": graphs}

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (benchmarks start each run cold). False, and nothing
        changes, while any request holds blocks."""
        return self.scheduler.kv.reset_prefix_cache()

    def _release_engine(self) -> None:
        """Drop the current runner (its KV cache and CUDA graphs) before building another."""
        if self.runner is None:
            return
        self.runner.close()
        self.runner = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _eos_ids(self) -> list[int]:
        ids = getattr(self.hf_config, "eos_token_id", None)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids = ids if ids is not None else self.tokenizer.eos_token_id
        if ids is None:
            return []
        return list(ids) if isinstance(ids, list | tuple) else [int(ids)]

    def _log_start(self, blocks: int, block_size: int) -> None:
        tokens = blocks * block_size
        logger.info(
            "model %s (%s, %s, %s); weights %s, quantization %s; KV cache: %d blocks x %d "
            "tokens = %d tokens, %s per token, %s",
            self.model_name,
            self.hf_config.architectures[0]
            if getattr(self.hf_config, "architectures", None)
            else "?",
            str(self.dtype).removeprefix("torch."),
            self.device,
            format_bytes(self._sizing["weights_bytes"]),
            self.quantization.describe(),
            blocks,
            block_size,
            tokens,
            format_bytes(self.layout.bytes_per_token),
            format_bytes(self.layout.bytes_per_token * tokens),
        )
        logger.info(
            "maximum concurrency for %d tokens per request: %.2fx",
            self.max_model_len,
            max_concurrency(blocks, block_size, self.max_model_len),
        )

    # ------------------------------------------------------------------ running

    def generate(
        self, prompts: Iterable[PromptInput], sampling_params: ParamsArg = None
    ) -> list[RequestOutput]:
        """Run every prompt; outputs in input order. Bad requests carry `error`, others go on."""
        outputs = list(self.stream(prompts, sampling_params))
        outputs.sort(key=lambda o: o.index)
        return outputs

    def beam_search(
        self, prompts: Iterable[PromptInput], params: BeamSearchParams | Seq[BeamSearchParams]
    ) -> list[RequestOutput]:
        """Beam search on every prompt; outputs in input order, each with `beam_width`
        hypotheses best first (text, token ids, `cumulative_logprob`).

        The beams of a request share their blocks (the prompt and every common prefix are
        stored once) and are scheduled and preempted as one unit; the hypotheses are those of
        transformers' `generate(num_beams=...)` with the same length penalty and early
        stopping. A step holding beams runs one token deep (`num_scheduler_steps` does not
        apply to it): the group chooses its beams between tokens.
        """
        if isinstance(params, BeamSearchParams):
            return self.generate(prompts, params)
        params = list(params)
        if not all(isinstance(p, BeamSearchParams) for p in params):
            raise TypeError("beam_search takes BeamSearchParams")
        return self.generate(prompts, params)

    def chat(
        self, conversations: Iterable[list[dict]], sampling_params: ParamsArg = None
    ) -> list[RequestOutput]:
        """Like `generate`, with each conversation rendered by the tokenizer's chat template."""
        return self.generate(({"messages": c} for c in conversations), sampling_params)

    def stream(
        self,
        prompts: Iterable[PromptInput],
        sampling_params: ParamsArg = None,
        should_stop: Callable[[], bool] | None = None,
        *,
        max_requests: int | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield each request's output as soon as it finishes (completion order).

        The input is consumed lazily: only about `max_num_seqs` requests wait in the queue at a
        time, so an iterator over a huge file is never held in memory at once. `should_stop` is
        asked before every step; once it answers True, everything in flight is aborted (its
        blocks freed, nothing yielded for it) and the stream ends. `max_requests` (the most
        prompts the input holds) sizes a replica pool's segments; one engine needs no bound.
        """
        feed = iter(enumerate(prompts))
        params_of = _params_picker(sampling_params)
        sched, low_water = self.scheduler, self.scheduler.config.max_num_seqs
        exhausted = False
        while True:
            if should_stop is not None and should_stop():
                self.abort_all()
                return
            while not exhausted and len(sched.waiting) < low_water:
                item = next(feed, None)
                if item is None:
                    exhausted = True
                    break
                yield from self.add_request(item[0], item[1], params_of(item[0]))
            if not sched.has_unfinished():
                if exhausted:
                    return
                continue
            if self._threads is not None:
                self._threads.tick()
            yield from self.step()

    def add_request(
        self, index: int, prompt: PromptInput, params: Params | None = None
    ) -> list[RequestOutput]:
        """Queue one request for `step` (`index`: its place in the caller's input, as
        `RequestOutput.index`); a bad or impossible one comes back at once as an error output.
        A prompt dict's own `sampling_params` win over `params`."""
        return self.tracker.add(index, prompt, params or SamplingParams(), self.scheduler)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_all(self) -> int:
        """Drop every request in flight; returns how many there were."""
        seqs = self.scheduler.unfinished()
        self.scheduler.finish(seqs, SequenceStatus.FINISHED_ABORTED)
        for seq in seqs:
            self.runner.release(seq)
        return self.tracker.clear()

    def close(self) -> None:
        """Free the KV cache and the step graphs; nothing runs on this engine after."""
        self._release_engine()

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that finished in it.

        With `num_scheduler_steps = k > 1`, a pure decode step whose graph exists runs `k` tokens
        deep (see `engine/core/multistep.py`); its results are applied one token at a
        time, stop checks included, exactly as `k` single steps would.

        A request on which the engine fails (the forward pass, the sampler or its text raising)
        ends alone, with `error_code="internal_error"`; the others in the step go on (see
        `containment.py`). KeyboardInterrupt, SystemExit and MemoryError still end the call.
        """
        out = self.scheduler.schedule()
        if out.swap_out or out.swap_in:
            self.runner.swap(out.swap_out, out.swap_in)
        k = self.config.num_scheduler_steps
        if (
            k > 1
            and self.runner.has_decode_graph(len(out.seqs))
            and self.scheduler.window.open(out, k)
        ):
            return self._decode_steps(out, k)
        return self._run_step(out)

    def _run_step(self, out: SchedulerOutput, finished: Seq[Sequence] = ()) -> list[RequestOutput]:
        result, failed = (
            execute_contained(self.runner, out) if out.seqs else (StepResult([], None), [])
        )
        # Failed requests finish before `update`, which then skips their rows.
        finished = [*finished, *self._fail_requests(failed)]
        self.tracker.record_logprobs(out, result)
        done = self.scheduler.update(out, result.sampled_token_ids, result.logprobs)
        if not out.seqs and not done and self.scheduler.has_unfinished():
            raise RuntimeError(  # an invariant, not a user error: never loop silently
                f"scheduler made no progress with {self.scheduler.num_unfinished} unfinished"
            )
        finished += done
        finished += self._stop_strings(out.seqs)
        return self._collect(finished)

    def _decode_steps(self, out: SchedulerOutput, k: int) -> list[RequestOutput]:
        finished: list[Sequence] = []
        steps = self.runner.execute_decode_steps(out, k)
        failure = None
        j = 0
        try:
            for j in range(k):
                try:
                    drawn = next(steps)
                except StopIteration:
                    break
                except MemoryError:
                    raise
                except Exception as exc:
                    failure = exc
                    break
                if j:
                    self.scheduler.window.count_step(out)
                finished += self.scheduler.update(out, [[t] for t in drawn])
                finished += self._stop_strings(out.seqs)
                if all(s.is_finished for s in out.seqs):
                    break
        finally:
            steps.close()
            self.scheduler.window.close(out.seqs)
        rest = [s for s in out.seqs if not s.is_finished]
        if failure is None or not rest:
            return self._collect(finished)
        # The window's results are applied up to the step that failed; every row left is a
        # decode (its last token not yet computed), so that step runs again as an ordinary
        # one-token step, where a failure is traced to its rows.
        logger.debug(
            "a %d-step decode window failed at step %d (%s: %s); its %d rows run one step",
            k, j, type(failure).__name__, failure, len(rest),
        )  # fmt: skip
        retry = SchedulerOutput(rest, [1] * len(rest), total_num_scheduled_tokens=len(rest))
        if j:
            self.scheduler.window.count_step(retry)
        return self._run_step(retry, finished)

    # ------------------------------------------------------------------ containment

    def _fail_requests(self, failed: list[tuple[Sequence, Exception]]) -> list[Sequence]:
        """Finish every sample of each request the engine failed on, running, waiting or just
        finished, with error code "internal_error"; return the sequences so finished."""
        groups: dict[str, tuple[list[Sequence], str]] = {}
        for seq, exc in failed:
            rid = seq.request_id
            if rid in groups:
                group, message = groups[rid]
                if all(s is not seq for s in group):  # finished before, failed now: mark it too
                    self.scheduler.fail([seq], "internal_error", message)
                    group.append(seq)
                continue
            sched = self.scheduler
            group = [seq] + [s for s in sched.unfinished() if s.request_id == rid and s is not seq]
            message = f"the engine failed on this request: {type(exc).__name__}: {exc}"
            groups[rid] = (group, message)
            logger.warning(
                "request %s failed; its %d sequence(s) end with an error, the others go on:\n%s",
                rid,
                len(group),
                "".join(traceback.format_exception(exc, limit=-6)).rstrip(),
            )
            sched.fail(group, "internal_error", message)
        return [s for group, _ in groups.values() for s in group]

    def _stop_strings(self, seqs: list[Sequence]) -> list[Sequence]:
        """Finish the sequences whose text reached a stop string, and fail the requests whose
        text could not be made; return both."""
        stopped, failed = self.tracker.check_stop_strings(seqs)
        if stopped:
            self.scheduler.finish(stopped, SequenceStatus.FINISHED_STOPPED)
        return stopped + self._fail_requests(failed)

    def _collect(self, finished: list[Sequence]) -> list[RequestOutput]:
        """Release finished sequences and hand back the requests they complete. Outputs are
        made first, so that a request whose text cannot be made fails whole (siblings still
        running included) instead of ending the call."""
        failed = self.tracker.render(finished)
        if failed:
            seen = {id(s) for s in finished}
            finished += [s for s in self._fail_requests(failed) if id(s) not in seen]
        for seq in finished:
            self.runner.release(seq)
        return self.tracker.collect(finished)

    @property
    def stats(self) -> dict:
        """Scheduler and prefix-cache counters, and the pool's current state."""
        kv = self.scheduler.kv
        sched = self.scheduler.stats
        block_bytes = self.layout.bytes_per_block(kv.block_size)
        costs = self.scheduler.costs
        return {
            "scheduler": asdict(sched),
            "prefix_cache": {**asdict(kv.stats), "hit_rate": kv.stats.hit_rate},
            "beam_search": asdict(self.scheduler.beam_stats),
            "swap": {
                "preemption_mode": self.config.preemption_mode,
                "num_host_blocks": kv.host.num_blocks if kv.host else 0,
                "swap_outs": sched.num_swap_outs,
                "swap_ins": sched.num_swap_ins,
                "blocks_out": sched.num_swapped_out_blocks,
                "blocks_in": sched.num_swapped_in_blocks,
                "bytes_moved": (sched.num_swapped_out_blocks + sched.num_swapped_in_blocks)
                * block_bytes,
                "transfer_s": self.runner.host_kv.seconds,
                "fallbacks_to_recompute": sched.num_swap_fallbacks,
                "recomputed_tokens": sched.num_recomputed_tokens,
                "swapped_now": self.scheduler.num_swapped,
                "costs": costs.as_dict() if costs else None,
            },
            "num_blocks": kv.num_blocks,
            "block_size": kv.block_size,
            "kv_usage": kv.usage,
        }

    @property
    def startup(self) -> dict[str, float | int | None]:
        """Seconds of each start-up phase (`import_s`, `load_s`, `profile_s`, `pool_s`,
        `capture_s`, ...; see `engine.startup`), their sum `engine_s`, and `compile_s`, the
        Triton JIT time inside them, with `kernels_compiled`. After `reconfigure`, that
        rebuild's phases."""
        return self._clock.as_dict()

    def snapshot(self) -> dict[str, Any]:
        """Where the engine stands, as plain values (a progress line's figures, `stats`,
        `memory`): what one replica of a scaled-out job reports."""
        sched, kv = self.scheduler, self.scheduler.kv
        return {
            "running": len(sched.running),  # sequences (a request of n samples runs n)
            "running_requests": len({seq.request_id for seq in sched.running}),
            "waiting": len(sched.waiting),
            "swapped": sched.num_swapped,
            "kv_usage": kv.usage,
            "peak_kv_usage": kv.stats.peak_used_blocks / kv.num_blocks,
            "stats": self.stats,
            "memory": self.memory,
            "startup": self.startup,
            "device": str(self.device),
        }

    def snapshots(self) -> list[dict[str, Any]]:
        """`[snapshot()]`: one process is one engine (a pool gives one per replica)."""
        return [self.snapshot()]


def _params_picker(sampling_params: ParamsArg):
    if sampling_params is None or isinstance(sampling_params, Params):
        params = sampling_params or SamplingParams()
        return lambda i: params
    listed = list(sampling_params)
    return lambda i: listed[i] if i < len(listed) else _missing(i, len(listed))


def _missing(i: int, n: int) -> SamplingParams:
    raise ValueError(f"{n} sampling params were given for more than {n} prompts (prompt {i})")
