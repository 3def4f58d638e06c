"""What runs on the replicas of a Ray pool (`engine.ray_data`): the engine replica, the ledger of
replica deaths, the feeder the driver hands requests to, and the probe that describes a replica
before any loads.

`EngineReplica` is a Ray Data `map_batches` class: one `LLM` in one `EngineThread` per actor,
several batches in its running batch at once. `Ledger` (one actor a pool) counts, per request,
the replica deaths it was running at: a batch holding such a request runs one request at a time,
alone on the replica, so the next death is charged to the request that caused it; a request
charged `max_crashes` deaths comes back as an error (`replica_died`) without running again.

Ray is imported by this module: import it only when Ray is installed (`pagedctl[ray]`).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import time
from typing import Any

import numpy as np
import ray
import ray.data

from ..core.config import EngineConfig
from ..models.source import resolve_model
from ..outputs import RequestOutput
from ..sizing.device import check_deterministic, resolve_device, resolve_dtype
from ..sizing.pool import model_max_len


def describe(settings: dict[str, Any]) -> dict[str, Any]:
    """What a replica built from `settings` will be, without loading weights: its model's
    name, dtype and device, and the longest sequence it is configured for (a replica's pool may
    cut it further; such requests are refused there)."""
    config = EngineConfig().replace(**settings)
    device = resolve_device(config.device)
    check_deterministic(config, device)  # where a replica would run, before any loads
    source = resolve_model(config.model, config.load_format)
    config_len = model_max_len(source.hf_config)
    return {
        "model_name": config.served_model_name or source.name,
        "source_name": source.name,
        "dtype": str(resolve_dtype(config.dtype, device)).removeprefix("torch."),
        "device": device.type,
        "max_model_len": config.max_model_len or config_len,
    }


# ---------------------------------------------------------------------- actors of the pool


class Ledger:
    """Which requests were running on a replica, and at how many replica deaths (one actor of
    it serves a pool: `LedgerActor`)."""

    def __init__(self, max_crashes: int) -> None:
        self.max_crashes = max_crashes
        self.running: set[str] = set()
        self.crashes: dict[str, int] = {}

    def begin(self, ids: list[str]) -> tuple[bool, dict[str, int]]:
        """A batch starts (again): charge a death to each request of it still marked running
        (its last attempt died). Returns whether to run it one request at a time, and the
        requests to give up with their deaths. A batch run whole is marked running whole."""
        for rid in ids:
            if rid in self.running:
                self.running.discard(rid)
                self.crashes[rid] = self.crashes.get(rid, 0) + 1
        give_up = {r: self.crashes[r] for r in ids if self.crashes.get(r, 0) >= self.max_crashes}
        alone = any(r in self.crashes for r in ids)
        if not alone:
            self.running.update(ids)
        return alone, give_up

    def start(self, rid: str) -> None:
        self.running.add(rid)

    def end(self, ids: list[str]) -> None:
        self.running.difference_update(ids)

    def deaths(self) -> int:
        return sum(self.crashes.values())

    def running_count(self) -> int:
        """Requests in a batch that a replica is running now."""
        return len(self.running)


LedgerActor = ray.remote(num_cpus=0)(Ledger)


@ray.remote(num_cpus=0)
class Feeder:
    """Segments of requests by index, put by the driver in order and read by `pull_segments`."""

    def __init__(self) -> None:
        self.segments: dict[int, list[bytes]] = {}
        self.top = -1  # the last segment put
        self.end: int | None = None
        self.cond = asyncio.Condition()

    async def put(self, k: int, rows: list[bytes]) -> None:
        async with self.cond:
            self.segments[k] = rows
            self.top = max(self.top, k)
            self.cond.notify_all()

    async def finish(self, end: int) -> None:
        async with self.cond:
            self.end = end
            self.cond.notify_all()

    async def drop(self, k: int) -> None:
        self.segments.pop(k, None)

    async def get(self, k: int) -> list[bytes] | None:
        """Segment `k`, waiting for it; [] for one already done, None past the end."""
        async with self.cond:
            while True:
                if k in self.segments:
                    return self.segments[k]
                if k <= self.top:
                    return []
                if self.end is not None and k >= self.end:
                    return None
                await self.cond.wait()


def pull_segments(batch: dict[str, np.ndarray], feeder) -> dict[str, np.ndarray]:
    """The segments numbered in `batch`, from the feeder."""
    rows = [r for k in batch["id"] for r in ray.get(feeder.get.remote(int(k))) or []]
    return {"request": np.array(rows, dtype=object)}


# ---------------------------------------------------------------------- the replica


class _SharedOrAlone:
    """Batches share the engine; a batch run alone waits for them to drain and holds it."""

    def __init__(self) -> None:
        self.cond = asyncio.Condition()
        self.shared = 0
        self.alone = False
        self.waiting_alone = 0

    async def share(self) -> None:
        async with self.cond:
            await self.cond.wait_for(lambda: not self.alone and not self.waiting_alone)
            self.shared += 1

    async def unshare(self) -> None:
        async with self.cond:
            self.shared -= 1
            self.cond.notify_all()

    async def hold(self) -> None:
        async with self.cond:
            self.waiting_alone += 1
            await self.cond.wait_for(lambda: not self.alone and not self.shared)
            self.waiting_alone -= 1
            self.alone = True

    async def release(self) -> None:
        async with self.cond:
            self.alone = False
            self.cond.notify_all()


class EngineReplica:
    """A `map_batches` class: one `LLM` per actor, each batch's requests run in it together with
    the other batches in flight (`max_concurrency`); a batch comes back when its last request
    ends. Columns in: `request` (a pickled prompt dict with `request_id` and `sampling_params`),
    optionally `row` (passed through). Out: `output` (a pickled `RequestOutput`), `replica`,
    `snapshot` (the engine's `LLM.snapshot()`, pickled, on the first row), and `row`."""

    def __init__(self, settings: dict[str, Any], ledger=None, threads_per_replica: int = 0):
        from ..llm import LLM
        from .engine_thread import EngineThread

        if threads_per_replica and "num_threads" not in settings:
            settings = {**settings, "num_threads": threads_per_replica}
        self.llm = LLM(**settings)
        self.engine = EngineThread(self.llm, on_fatal=_die)
        self.ledger = ledger
        self.replica = f"{ray.util.get_node_ip_address()}:{os.getpid()}"
        self._lock: _SharedOrAlone | None = None
        self.ready_at = time.time()  # the model loaded and the pool sized

    async def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._lock is None:
            self._lock = _SharedOrAlone()
        prompts = [pickle.loads(b) for b in batch["request"]]
        ids = [p["request_id"] for p in prompts]
        alone, give_up = False, {}
        if self.ledger is not None:
            alone, give_up = await self.ledger.begin.remote(ids)
        outputs: list[RequestOutput] = []
        if alone:
            await self._lock.hold()
            try:
                for index, prompt in enumerate(prompts):
                    rid = prompt["request_id"]
                    if rid in give_up:
                        outputs.append(_gave_up(rid, index, give_up[rid]))
                        continue
                    await self.ledger.start.remote(rid)
                    outputs += await self._run([prompt])
                    self.ledger.end.remote([rid])
            finally:
                await self._lock.release()
        else:
            await self._lock.share()
            try:
                outputs = await self._run(prompts)
            finally:
                await self._lock.unshare()
            if self.ledger is not None:
                self.ledger.end.remote(ids)
        by_id = {o.request_id: o for o in outputs}
        ordered = [by_id[r] for r in ids]
        rows = batch.get("row")
        return {
            "output": np.array([pickle.dumps(o) for o in ordered], dtype=object),
            "replica": np.array([self.replica] * len(ordered), dtype=object),
            "snapshot": np.array(
                [pickle.dumps({**self.engine.snapshot, "ready_at": self.ready_at})]
                + [b""] * (len(ordered) - 1),
                dtype=object,
            ),
            **({"row": rows} if rows is not None else {}),
        }

    async def _run(self, prompts: list[dict]) -> list[RequestOutput]:
        loop = asyncio.get_running_loop()
        done: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.engine.submit(prompts, lambda out: loop.call_soon_threadsafe(done.put_nowait, out))
        return [await done.get() for _ in prompts]


def _gave_up(request_id: str, index: int, deaths: int) -> RequestOutput:
    return RequestOutput(
        request_id,
        index,
        None,
        [],
        error=f"a replica died {deaths} times while running this request; it is not run again",
        error_code="replica_died",
    )


def _die(exc: BaseException) -> None:
    """A failure the engine did not contain: end the process, so Ray restarts the replica and
    the ledger charges the death to the requests that were running."""
    import traceback

    traceback.print_exception(exc)
    os._exit(70)


# ---------------------------------------------------------------------- resources


def replica_resources(replicas: int) -> dict[str, Any]:
    """One GPU per replica where the cluster has GPUs; else an equal share of its CPUs, and as
    many engine threads."""
    total = ray.cluster_resources()
    if total.get("GPU", 0) >= 1:
        return {"num_gpus": 1, "num_cpus": 1, "threads": 0}
    cpus = max(1, (int(total.get("CPU", 1)) - 1) // replicas)  # one left for the pipeline
    return {"num_gpus": 0, "num_cpus": cpus, "threads": cpus}


def replica_stage(
    ds,
    settings: dict[str, Any],
    replicas: int,
    batch_size: int,
    max_concurrent_batches: int,
    ledger=None,
):
    res = replica_resources(replicas)
    return ds.map_batches(
        EngineReplica,
        fn_constructor_kwargs={
            "settings": settings,
            "ledger": ledger,
            "threads_per_replica": res["threads"],
        },
        batch_size=batch_size,
        batch_format="numpy",
        zero_copy_batch=True,
        compute=ray.data.ActorPoolStrategy(
            size=replicas,
            max_tasks_in_flight_per_actor=max_concurrent_batches,
            max_concurrent_calls_per_actor=max_concurrent_batches,
        ),
        num_gpus=res["num_gpus"] or None,
        num_cpus=res["num_cpus"],
    )
