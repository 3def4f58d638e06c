"""pagedctl: offline batch LLM inference and KV-cache capacity planning on a paged engine."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pagedctl")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+source"
