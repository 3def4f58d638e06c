"""A scaled-out job's engine: `--replicas N` engines on a Ray cluster, as the job sees one.

`ScaledOut` gives `GenerateJob` what it reads of an `LLM` (model name, dtype, longest sequence,
tokenizer, `stream`) from `engine.ray_data.ReplicaPool`, whose replicas load the model; the
driver loads only the tokenizer (for logprob bytes) and touches no device.
"""

from __future__ import annotations

from typing import Any

from pagedctl.engine import load_tokenizer, resolve_model
from pagedctl.exits import EXIT_TEMPFAIL
from pagedctl.generate.errors import JobExit


class ScaledOut:
    def __init__(self, settings: dict[str, Any], replicas: int, address: str | None) -> None:
        from pagedctl.engine import ReplicaPool

        self.source = resolve_model(settings["model"], settings.get("load_format", "auto"))
        self.tokenizer = load_tokenizer(self.source) if self.source.tokenizer_dir else None
        try:
            self.pool = ReplicaPool(settings, replicas, address)
        except (ConnectionError, *ray_errors()) as e:
            where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
            raise JobExit(
                EXIT_TEMPFAIL,
                f"cannot start the replicas on {where}: {str(e).splitlines()[0]}; nothing was "
                "written: rerun once the cluster is up (a cluster with token authentication "
                "needs RAY_AUTH_MODE=token and its token here)",
            ) from None
        facts = self.pool.facts
        self.model_name: str = facts["model_name"]
        self.dtype: str = facts["dtype"]
        self.device: str = facts["device"]
        self.max_model_len: int = facts["max_model_len"]

    @property
    def done_by(self) -> dict[str, dict[str, int]]:
        return self.pool.done_by

    def stream(self, prompts, should_stop=None, *, max_requests: int):
        return self.pool.stream(prompts, should_stop, max_requests=max_requests)

    def snapshots(self) -> list[dict[str, Any]]:
        return list(self.pool.snapshots.values())

    def deaths(self) -> int:
        return self.pool.deaths()

    def abort_all(self) -> int:
        return self.pool.abort_all()

    def close(self) -> None:
        self.pool.close()


def ray_errors() -> tuple[type[BaseException], ...]:
    """What Ray raises for a cluster it cannot join or run on."""
    import ray.exceptions

    return (ray.exceptions.RayError, RuntimeError)
