"""`Engine`: what a batch job reads of the engine it runs on, this process's `LLM` or a pool of
replicas on a Ray cluster (`ReplicaPool`).

A job streams its requests through `stream`, records each result as it comes, and reports the
engine's figures; it never asks which engine it holds. The two differ in what they report, not
in how they are asked: one `LLM` is one process, with a start-up of its own (`startup`) and no
replica table (`replicas` is None); a pool has a table (`Replicas`: each replica's share, the
deaths charged) and no start-up of its own, since its replicas load inside the run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .models.source import ModelSource
    from .outputs import RequestOutput


@dataclass(frozen=True)
class ReplicaShare:
    """One replica's part of a run so far: the requests it returned, their output tokens, and
    its engine's preemptions as of its latest snapshot."""

    name: str
    requests: int
    output_tokens: int
    preemptions: int


@runtime_checkable
class Replicas(Protocol):
    """The replica table of an engine spread over replicas."""

    size: int  # the replicas it runs

    def shares(self) -> list[ReplicaShare]:
        """Each replica that returned a result, in the order they first did."""
        ...

    def deaths(self) -> int:
        """Replica deaths charged to requests so far."""
        ...


@runtime_checkable
class Engine(Protocol):
    """An engine started and ready to run requests, as a job reads it."""

    model_name: str  # the name results carry (the served name)
    dtype: Any  # a torch.dtype, or its name where no tensor lives in this process
    device: Any  # a torch.device, or its type's name
    max_model_len: int
    tokenizer: Any  # the model's tokenizer, None for a model without one
    source: ModelSource  # where the model came from
    startup: dict[str, Any] | None  # seconds of each start-up phase; None: no start-up here
    replicas: Replicas | None  # None: one process, no replica table

    def stream(
        self,
        prompts: Iterable[dict],
        *,
        should_stop: Callable[[], bool] | None = None,
        max_requests: int,
    ) -> Iterator[RequestOutput]:
        """Each request's output as it finishes (completion order). `prompts` is read lazily
        and holds at most `max_requests` prompts; once `should_stop` answers True the stream
        ends, with what was in flight dropped."""
        ...

    def abort_all(self) -> int:
        """Drop what runs in this process; returns how many requests that was."""
        ...

    def snapshots(self) -> list[dict[str, Any]]:
        """Each engine's latest `LLM.snapshot()`: one for one process, one a replica that
        reported."""
        ...

    def close(self) -> None:
        """Release what the engine holds (its KV cache, a cluster it started)."""
        ...
