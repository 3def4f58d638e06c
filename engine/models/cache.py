"""pagedctl's model cache: converted models, built aside, verified, then renamed into place.

A folder appears whole (manifest included) or not at all, and one process at a time builds it, so
a crash or a second job never sees half a model.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .gguf import MANIFEST, GGUFConversionError, convert_gguf, sha256_file
from .registry import expected_weight_shapes
from .weights import iter_weights, load_tokenizer, source_from_folder


def cache_dir() -> Path:
    """pagedctl's cache folder: `$PAGEDCTL_HOME`, else the platform's user cache dir."""
    if os.environ.get("PAGEDCTL_HOME"):
        return Path(os.environ["PAGEDCTL_HOME"]).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("pagedctl"))


def is_installed(folder: Path) -> bool:
    """Whether a converted folder is in place (it appears whole, manifest included, by a rename)."""
    return (folder / MANIFEST).is_file()


def convert_gguf_cached(gguf_path: Path) -> Path:
    """Convert a `.gguf` file once into `$PAGEDCTL_HOME/models/gguf/<stem>-<sha256[:16]>`."""
    digest = sha256_file(gguf_path)
    target = cache_dir() / "models" / "gguf" / f"{gguf_path.stem}-{digest[:16]}"
    return install(target, lambda out: convert_gguf(gguf_path, out), force=False)


def install(target: Path, build: Callable[[Path], Any], force: bool) -> Path:
    """Build in a temp folder beside `target`, verify, rename into place; one process at a time."""
    if is_installed(target) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if is_installed(target) and not force:  # another process finished while we waited
            return target
        for stale in target.parent.iterdir():  # leftovers of a crashed run; we hold the lock
            if stale.name.startswith((f".{target.name}.tmp-", f".{target.name}.old-")):
                shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp)
            verify_model_dir(tmp)
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            if target.exists():
                os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # already renamed away unless something failed
    return target


def verify_model_dir(folder: Path) -> None:
    """Check a model folder: every tensor its config implies, with the right shape and finite
    values; the tokenizer (if any) loads, round-trips a string and renders its chat template.

    Raises:
        GGUFConversionError: naming the first problems found.
    """
    source = source_from_folder(str(folder), folder)
    expected = expected_weight_shapes(source.hf_config)
    problems, seen = [], set()
    for name, w in iter_weights(source):
        seen.add(name)
        if name not in expected:
            problems.append(f"unexpected tensor {name}")
        elif tuple(w.shape) != expected[name]:
            problems.append(f"{name} has shape {tuple(w.shape)}, expected {expected[name]}")
        # The fp32 sum of fp16 values is finite iff all of them are (and it is much faster).
        elif not bool(torch.isfinite(w.sum(dtype=torch.float32))):
            problems.append(f"{name} has non-finite values")
    problems += [f"missing tensor {name}" for name in sorted(expected.keys() - seen)]
    if source.tokenizer_dir is not None:
        problems += _tokenizer_problems(load_tokenizer(source))
    if problems:
        raise GGUFConversionError(f"{folder} failed verification: {'; '.join(problems[:5])}")


def _tokenizer_problems(tok: Any) -> list[str]:
    text = "Paged attention: 16 tokens per block, naïve → fine."
    if (back := tok.decode(tok.encode(text, add_special_tokens=False))) != text:
        return [f"tokenizer round trip changed {text!r} into {back!r}"]
    if tok.chat_template is None:
        return []
    chat = [{"role": "user", "content": "ping"}]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return [] if "ping" in rendered else [f"chat template renders {rendered!r} without the message"]


@contextlib.contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # Windows: no cross-process lock; the atomic rename still protects readers
        yield
        return
    with lock_file.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
