"""Many engines at once on Ray Data: requests in as a dataset, one engine per replica actor.

`build_processor` maps a dataset of requests to a dataset of results, for pipelines that are
already Ray Data's (the shape of `ray.data.llm.build_llm_processor`). `ReplicaPool` is what
`pagedctl generate --replicas N` runs: the job's driver keeps its files, and the requests it reads
flow through one dataset to N `EngineReplica` actors, their results streaming back as they finish.
It is an `engine.protocol.Engine`, as one `LLM` is: the driver loads the tokenizer (for a job's
logprob bytes) and touches no device; `replicas` tallies what each replica returned.

How a request travels (ReplicaPool):

    driver: segments of requests -> Feeder actor (a window of them, so memory stays flat)
    range(segments) -> map_batches(pull_segments): segment k from the feeder, in batches
        -> map_batches(EngineReplica, concurrency=N)
    EngineReplica: every batch into one EngineThread (several batches share the running batch);
        a batch's results come back in one block when its last request ends
    driver: iter_batches -> the job's records

A replica that dies (killed, out of memory, a failure the engine does not contain) is restarted
by Ray and its batches run again; the pool's `Ledger` charges each death to the requests that
were running and gives a request up after `max_crashes`. What runs on the replicas
(`EngineReplica`, `Ledger`, the feeder, the probe) and how a death is charged: `engine.ray_replica`.

Ray is imported by this module: import it only when Ray is installed (`pagedctl[ray]`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import queue
import sys
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, is_dataclass
from typing import Any

import numpy as np
import ray
import ray.data
import ray.exceptions
from ray.data._internal.datasource.range_datasource import RangeDatasource

from ..core.config import EngineConfig
from ..core.sampling_params import SamplingParams
from ..core.units import cdiv
from ..models.source import resolve_model
from ..models.weights import load_tokenizer
from ..outputs import RequestOutput
from ..protocol import ReplicaShare
from . import ClusterUnavailable
from .ray_replica import (
    Feeder,
    LedgerActor,
    describe,
    pull_segments,
    replica_resources,
    replica_stage,
)

MAX_CRASHES = 3  # deaths a request may be running at before it is given up
LEDGER_NAME = "pagedctl-ledger"  # a pool's ledger actor is named this and a suffix of its own
SEGMENT = 256  # requests the driver hands over at a time
REPLICA_START_S = 1800  # the longest a pool waits for its replicas to load


# ---------------------------------------------------------------------- the job's pool


class ReplicaPool:
    """N engine replicas behind one dataset, fed from the driver's iterator (`stream`).

    Args:
        settings: the `EngineConfig` fields every replica is built from.
        replicas: how many.
        address: a Ray cluster to join ("auto", "HOST:PORT"); None starts a local one (or joins
            `RAY_ADDRESS`).
        max_concurrent_batches: batches in one replica's engine at a time (default: enough to
            fill `max_num_seqs`). A batch is a segment of the input: at most `SEGMENT`
            requests, fewer for a short job, so that each replica gets several.

    Raises:
        ClusterUnavailable: Ray could not start or join the cluster, or run on it (the model
            is found and its tokenizer loaded before Ray starts).
        ValueError: the model is not found, or the cluster cannot hold the replicas.
    """

    startup = None  # the replicas load inside the run: no start-up of the pool's own

    def __init__(
        self,
        settings: dict[str, Any],
        replicas: int,
        address: str | None = None,
        *,
        max_concurrent_batches: int | None = None,
        max_crashes: int = MAX_CRASHES,
    ) -> None:
        self.settings = settings
        self.source = resolve_model(settings["model"], settings.get("load_format", "auto"))
        self.tokenizer = load_tokenizer(self.source) if self.source.tokenizer_dir else None
        self.max_num_seqs = settings.get("max_num_seqs") or 256
        self.max_concurrent_batches = max_concurrent_batches
        try:
            self.facts, ledger = self._start(replicas, address, max_crashes)
        except (ConnectionError, ray.exceptions.RayError, RuntimeError) as e:
            raise ClusterUnavailable(str(e)) from e
        self.replicas = ReplicaTally(replicas, ledger)
        self._feeder = None

    def _start(self, replicas: int, address: str | None, max_crashes: int) -> tuple[dict, Any]:
        """Join the cluster (or start one) and check that it can hold the replicas; returns
        what a replica will be (`describe`) and the pool's ledger, started."""
        _quiet_ray_data()
        if not ray.is_initialized():
            # Ray's own lines on this process's stderr would break a JSON log: its start-up
            # is silenced, its C++ log kept to fatal errors (the log files keep the rest).
            os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
            with _fds_silenced():
                ray.init(
                    address=address,
                    include_dashboard=False,
                    log_to_driver=False,
                    configure_logging=False,
                )
        resources = replica_resources(replicas)
        total = ray.cluster_resources()
        gpus, cpus = int(total.get("GPU", 0)), int(total.get("CPU", 0))
        if resources["num_gpus"] and gpus < replicas:
            raise ValueError(f"{replicas} replicas need {replicas} GPUs; the cluster has {gpus}")
        if not resources["num_gpus"] and cpus < replicas * resources["num_cpus"]:
            raise ValueError(
                f"{replicas} replicas need a CPU each and the cluster has {cpus}: use fewer"
            )
        probe = ray.remote(describe).options(num_gpus=resources["num_gpus"] or None, num_cpus=1)
        facts = ray.get(probe.remote(self.settings))
        # Named, so that `ray list actors` (and the tests) can find a pool's ledger.
        name = f"{LEDGER_NAME}-{uuid.uuid4().hex[:12]}"
        return facts, LedgerActor.options(name=name).remote(max_crashes)

    @property
    def model_name(self) -> str:
        return self.facts["model_name"]

    @property
    def dtype(self) -> str:
        return self.facts["dtype"]

    @property
    def device(self) -> str:
        return self.facts["device"]

    @property
    def max_model_len(self) -> int:
        return self.facts["max_model_len"]

    def snapshots(self) -> list[dict[str, Any]]:
        """Each replica's latest `LLM.snapshot()`, of those that returned a result."""
        return self.replicas.snapshots()

    def stream(
        self,
        prompts: Iterable[dict],
        should_stop: Callable[[], bool] | None = None,
        *,
        max_requests: int,
    ) -> Iterator[RequestOutput]:
        """Yield each request's output as its batch comes back (completion order), each request
        once. The input (at most `max_requests` prompts) is read as the window has room.
        `should_stop` is asked between results; once it answers True the stream ends, what is
        in flight unreturned (`close` ends the replicas)."""
        feeder = Feeder.remote()
        # A replica takes a block at a time, so a segment is one block and one batch: small
        # enough that every replica gets several, at most SEGMENT.
        replicas = self.replicas.size
        segment = min(SEGMENT, max(1, cdiv(max_requests, 4 * replicas)))
        batches = self.max_concurrent_batches or max(2, cdiv(self.max_num_seqs, segment))
        window = max(2 * segment, replicas * batches * segment * 2)
        num_segments = cdiv(max(max_requests, 1), segment) + 1
        ds = ray.data.read_datasource(
            RangeDatasource(num_segments, column_name="id"),
            override_num_blocks=num_segments,
            num_cpus=0,
        )
        ds = ds.map_batches(
            pull_segments,
            fn_kwargs={"feeder": feeder},
            batch_size=1,
            batch_format="numpy",
            compute=ray.data.TaskPoolStrategy(size=2),
            num_cpus=0,
        )
        ledger = self.replicas.ledger
        ds = replica_stage(ds, self.settings, replicas, segment, batches, ledger)
        results: queue.Queue = queue.Queue(maxsize=64)
        self._feeder = feeder
        feed = iter(prompts)
        first = next(feed, None)
        if first is None:  # nothing to run: no dataset, no replicas started
            return
        feed = itertools.chain([first], feed)
        threading.Thread(target=_drain, args=(ds, results), daemon=True).start()
        segment_of: dict[str, int] = {}
        left: dict[int, int] = {}  # segment -> requests without a result yet
        current: list[bytes] = []
        k = 0
        exhausted = finished = False
        while True:
            if should_stop is not None and should_stop():
                return
            while not exhausted and len(segment_of) < window:
                prompt = next(feed, None)
                if prompt is None:
                    exhausted = True
                    break
                rid = prompt["request_id"]
                if rid in segment_of:  # the driver's own ids are unique; refuse, not hang
                    yield _duplicate(rid)
                    continue
                segment_of[rid] = k
                current.append(pickle.dumps(prompt))
                if len(current) >= segment:
                    break
            if current and (len(current) >= segment or exhausted or len(segment_of) >= window):
                left[k] = len(current)
                feeder.put.remote(k, current)
                current, k = [], k + 1
            if exhausted and not finished:
                feeder.finish.remote(k)
                finished = True
            if finished and not segment_of:
                return
            try:
                item = results.get(timeout=0.2)
            except queue.Empty:
                continue
            if isinstance(item, BaseException):
                raise item
            if item is None:  # the dataset ended with requests unreturned: the job says so
                return
            for out, replica, snap in item:
                seg = segment_of.pop(out.request_id, None)
                if seg is None:
                    continue  # a batch run again after its replica died: already had
                self.replicas.record(out, replica, snap)
                left[seg] -= 1
                if not left[seg]:
                    del left[seg]
                    feeder.drop.remote(seg)
                yield out

    def abort_all(self) -> int:
        return 0  # nothing runs here; `close` ends the replicas

    def close(self) -> None:
        """Stop feeding (the pulls end), then leave the cluster; a cluster this pool started
        ends with it."""
        if self._feeder is not None:
            with contextlib.suppress(Exception):
                ray.get(self._feeder.finish.remote(0), timeout=10)
        ray.shutdown()


class ReplicaTally:
    """A pool's `Replicas` table: what each replica returned (its requests, their output
    tokens, its latest `LLM.snapshot()`), and the deaths the pool's ledger charged."""

    def __init__(self, size: int, ledger) -> None:
        self.size = size
        self.ledger = ledger
        self._latest: dict[str, dict[str, Any]] = {}  # replica -> its latest LLM.snapshot()
        self._done: dict[str, dict[str, int]] = {}  # replica -> requests, output tokens

    def record(self, out: RequestOutput, replica: str, snap: dict[str, Any] | None) -> None:
        """A result the driver takes from `replica` (with its snapshot, on a batch's first)."""
        if snap is not None:
            self._latest[replica] = snap
        mine = self._done.setdefault(replica, {"requests": 0, "output_tokens": 0})
        mine["requests"] += 1
        mine["output_tokens"] += sum(len(o.token_ids) for o in out.outputs)

    def snapshots(self) -> list[dict[str, Any]]:
        return list(self._latest.values())

    def shares(self) -> list[ReplicaShare]:
        return [
            ReplicaShare(name, done["requests"], done["output_tokens"], self._preemptions(name))
            for name, done in self._done.items()
        ]

    def deaths(self) -> int:
        return ray.get(self.ledger.deaths.remote())

    def _preemptions(self, replica: str) -> int:
        snap = self._latest.get(replica, {})
        return snap.get("stats", {}).get("scheduler", {}).get("num_preemptions", 0)


@contextlib.contextmanager
def _fds_silenced() -> Iterator[None]:
    """stdout and stderr to /dev/null at the descriptor level (Ray's C++ writes there)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def _quiet_ray_data() -> None:
    """Ray Data's warnings go through this process's logging (JSON lines in a JSON log), its
    progress and information lines nowhere: the job reports its own. A pool starts work once
    all its replicas are up (they load at once), so that none sits idle from the start."""
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.wait_for_min_actors_s = REPLICA_START_S
    log = logging.getLogger("ray.data")
    log.handlers = [h for h in log.handlers if isinstance(h, logging.FileHandler)]
    log.setLevel(logging.WARNING)
    log.propagate = True


def _drain(ds, results: queue.Queue) -> None:
    try:
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=2):
            snaps = [pickle.loads(s) if s else None for s in batch["snapshot"]]
            outs = [pickle.loads(b) for b in batch["output"]]
            results.put(list(zip(outs, batch["replica"], snaps, strict=True)))
        results.put(None)
    except BaseException as exc:  # handed to the driver, which raises it
        results.put(exc)


def _duplicate(rid: str) -> RequestOutput:
    msg = f"request id {rid!r} is already in flight"
    return RequestOutput(rid, 0, None, [], error=msg, error_code="duplicate_id")


# ---------------------------------------------------------------------- the library entry


def build_processor(
    config: EngineConfig | dict[str, Any],
    sampling: SamplingParams | dict[str, Any] | None = None,
    *,
    replicas: int = 1,
    batch_size: int = 16,
    max_concurrent_batches: int = 8,
    preprocess: Callable[[dict], dict] | None = None,
    postprocess: Callable[[dict], dict] | None = None,
) -> Callable[[Any], Any]:
    """A function from a dataset of requests to a dataset of results, run on `replicas`
    engines (one GPU each where the cluster has GPUs).

    A row gives `prompt` (text), `messages` (a chat) or `prompt_token_ids`, and optionally
    `sampling_params` (a dict of `SamplingParams` fields; `sampling` for rows without one).
    `preprocess` maps a row of yours to that shape first. Each result row is the input row
    with `generated_text`, `generated_token_ids`, `num_prompt_tokens`, `finish_reason`,
    `error` and `error_code` added (`error` is None unless the engine refused the request),
    then `postprocess` maps it. Rows come back in completion order, not input order.

        processor = build_processor({"model": "qwen2.5-0.5b-instruct"}, {"max_tokens": 64},
                                    replicas=2)
        results = processor(ray.data.from_items([{"prompt": "Hello"}]))
    """
    settings = asdict(config) if is_dataclass(config) else dict(config)
    settings = {k: v for k, v in settings.items() if v is not None}
    default = sampling
    if not isinstance(default, SamplingParams):
        default = SamplingParams(**(sampling or {}))

    def to_requests(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = _rows(batch)
        requests = [_request(preprocess(r) if preprocess else r, default) for r in rows]
        return {
            "request": np.array([pickle.dumps(q) for q in requests], dtype=object),
            "row": np.array([pickle.dumps(r) for r in rows], dtype=object),
        }

    def to_results(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = []
        for raw_out, raw_row in zip(batch["output"], batch["row"], strict=True):
            row = {**pickle.loads(raw_row), **_result(pickle.loads(raw_out))}
            out.append(postprocess(row) if postprocess else row)
        keys = list(dict.fromkeys(k for row in out for k in row))
        return {k: _column([row.get(k) for row in out]) for k in keys}

    def processor(ds):
        _quiet_ray_data()
        ds = ds.map_batches(to_requests, batch_format="numpy")
        # A replica takes a block at a time: blocks of one batch spread over all of them.
        ds = ds.repartition(target_num_rows_per_block=batch_size)
        ds = replica_stage(ds, settings, replicas, batch_size, max_concurrent_batches)
        return ds.map_batches(to_results, batch_format="numpy")

    return processor


def _column(values: list) -> np.ndarray:
    column = np.empty(len(values), dtype=object)
    column[:] = values
    return column


def _rows(batch: dict[str, np.ndarray]) -> list[dict]:
    names = list(batch)
    n = len(batch[names[0]]) if names else 0
    return [{k: _plain(batch[k][i]) for k in names} for i in range(n)]


def _plain(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return [_plain(x) for x in v.tolist()] if v.dtype == object else v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v


def _request(row: dict, default: SamplingParams) -> dict:
    params = row.get("sampling_params")
    request: dict[str, Any] = {
        "request_id": uuid.uuid4().hex,
        "sampling_params": SamplingParams(**params) if params else default,
    }
    for key in ("messages", "prompt", "prompt_token_ids"):
        if row.get(key) is not None:
            request[key] = row[key]
            break
    else:
        raise ValueError("a row needs prompt, messages or prompt_token_ids")
    return request


def _result(out: RequestOutput) -> dict[str, Any]:
    first = out.outputs[0] if out.outputs else None
    return {
        "generated_text": first.text if first else None,
        "generated_token_ids": list(first.token_ids) if first else None,
        "num_prompt_tokens": len(out.prompt_token_ids),
        "finish_reason": first.finish_reason if first else "error",
        "error": out.error,
        "error_code": out.error_code,
    }
