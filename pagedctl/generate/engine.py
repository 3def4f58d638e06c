"""The engine a `generate` command runs on: this process's `LLM`, or `--replicas N` engines on a
Ray cluster (`ReplicaPool`, whose replicas load the model). Both are an `Engine`, so the job
never asks which one it holds; `start_engine` is the one place that chooses.

`EngineSlot` holds the engine of a command: started by the first run that needs one (a run whose
output is complete loads no model), closed by whoever made the slot. A job given none makes its
own and closes it at its end; a spool folder makes one that all its files run on, and closes it
after the last.
"""

from __future__ import annotations

from pagedctl.engine import ClusterUnavailable, Engine, TokenBytes
from pagedctl.exits import EXIT_TEMPFAIL, EXIT_USAGE
from pagedctl.generate.errors import JobExit, StopSignals
from pagedctl.generate.recipe import JobSettings


def start_engine(s: JobSettings, stop: StopSignals) -> Engine:
    """Load the model and size the KV pool, or with `replicas` start them; JobExit for
    settings that cannot start (64) and for a cluster that cannot run them now (75)."""
    from pagedctl.engine import LLM  # torch: only once a model is to load
    from pagedctl.models.bundled import engine_settings

    try:
        settings = engine_settings(s.engine)
        if s.replicas is None:
            return LLM(**settings)
        return _start_replicas(settings, s.replicas, s.ray_address, stop)
    except ValueError as e:  # ModelNotFoundError, UnsupportedModelError, ConfigError
        raise JobExit(EXIT_USAGE, f"cannot start the engine: {e}") from None


def _start_replicas(
    settings: dict, replicas: int, address: str | None, stop: StopSignals
) -> Engine:
    from pagedctl.engine import ReplicaPool  # Ray: only for a scaled-out job

    try:
        pool = ReplicaPool(settings, replicas, address)
    except ClusterUnavailable as e:
        where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
        raise JobExit(
            EXIT_TEMPFAIL,
            f"cannot start the replicas on {where}: {str(e).splitlines()[0]}; nothing was "
            "written: rerun once the cluster is up (a cluster with token authentication "
            "needs RAY_AUTH_MODE=token and its token here)",
        ) from None
    stop.take_back()  # Ray's start-up sets SIGTERM's handler its way
    return pool


class EngineSlot:
    """The engine the runs of one command share, started on first need."""

    def __init__(self, settings: JobSettings) -> None:
        self.settings = settings  # the engine's (a spool folder's files differ in paths only)
        self.engine: Engine | None = None
        self.token_bytes: TokenBytes | None = None  # logprob bytes, for every run on the engine

    def start(self, stop: StopSignals) -> Engine:
        """The engine, started now if no run started it before."""
        if self.engine is None:
            self.engine = start_engine(self.settings, stop)
            if self.engine.tokenizer is not None:
                self.token_bytes = TokenBytes(self.engine.tokenizer)
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
