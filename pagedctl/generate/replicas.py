"""A scaled-out job's engine: `--replicas N` engines on a Ray cluster, as the job sees one.

`ScaledOut` gives `GenerateJob` what it reads of an `LLM` (model name, dtype, longest sequence,
tokenizer, `stream`) from `engine.ray_data.ReplicaPool`, whose replicas load the model; the
driver loads only the tokenizer (for logprob bytes) and touches no device.
"""

from __future__ import annotations

from typing import Any

from pagedctl.engine.model_source import resolve_model
from pagedctl.engine.weights import load_tokenizer


class ScaledOut:
    def __init__(self, settings: dict[str, Any], replicas: int, address: str | None) -> None:
        from pagedctl.engine.ray_data import ReplicaPool

        self.source = resolve_model(settings["model"], settings.get("load_format", "auto"))
        self.tokenizer = load_tokenizer(self.source) if self.source.tokenizer_dir else None
        self.pool = ReplicaPool(settings, replicas, address)
        facts = self.pool.facts
        self.model_name: str = facts["model_name"]
        self.dtype: str = facts["dtype"]
        self.device: str = facts["device"]
        self.max_model_len: int = facts["max_model_len"]

    @property
    def done_by(self) -> dict[str, dict[str, int]]:
        return self.pool.done_by

    def stream(self, prompts, should_stop=None):
        return self.pool.stream(prompts, should_stop)

    def snapshots(self) -> list[dict[str, Any]]:
        return list(self.pool.snapshots.values())

    def deaths(self) -> int:
        return self.pool.deaths()

    def abort_all(self) -> int:
        return self.pool.abort_all()

    def close(self) -> None:
        self.pool.close()
