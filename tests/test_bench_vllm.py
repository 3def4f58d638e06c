"""vLLM as a `pagedctl bench` peer: said plainly when it is not installed; the child process,
its pipes and the comparison of outputs through a stand-in `vllm` package (CI cannot install
vLLM); the real vLLM where it is installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedctl.bench.vllm_peer import PeerUnavailable, VLLMProcess, vllm_version
from pagedctl.engine import resolve_model

ROOT = Path(__file__).resolve().parent.parent

# Answers as a greedy model would: a function of the prompt alone, the same in every batch.
FAKE_VLLM = """
__version__ = "0.0.0+stand-in"
import json, os


class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Out:
    def __init__(self, ids):
        self.outputs = [type("C", (), {"token_ids": ids})()]


class LLM:
    def __init__(self, **kw):
        if os.environ.get("FAKE_VLLM_FAIL") == "init":
            raise ValueError("no such model")
        json.load(open(os.path.join(kw["model"], "config.json")))  # the folder it was given
        self.kw = kw

    def generate(self, prompts, params, use_tqdm=True):
        if not isinstance(params, list):
            params = [params] * len(prompts)
        if os.environ.get("FAKE_VLLM_FAIL") == "generate" and len(prompts) > 2:
            raise RuntimeError("out of KV blocks")
        return [_Out([(sum(p["prompt_token_ids"]) + i) % 97 for i in range(s.max_tokens)])
                for p, s in zip(prompts, params)]
"""


@pytest.fixture
def fake_vllm(tmp_path: Path) -> dict:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    return {"env": {"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}}


def _no_vllm_python(tmp_path: Path) -> str:
    """An interpreter without vLLM: this one, unless vLLM is installed here."""
    if vllm_version(sys.executable) is None:
        return sys.executable
    pytest.skip("vLLM is installed for this interpreter")


def test_not_installed_is_said_plainly_and_the_bench_goes_on(tmp_path: Path) -> None:
    python = _no_vllm_python(tmp_path)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "model: tiny-llama\nload_format: dummy\ndevice: cpu\nworkload:\n  num_requests: 3\n"
        f"  prompt_len: [4, 8]\n  output_len: [2, 3]\n  token_ids: [0, 500]\n  temperature: 0\n"
        f"peers:\n  vllm:\n"
        f"    python: {python}\n"
    )
    out = tmp_path / "res.json"
    cmd = [sys.executable, "-m", "pagedctl", "bench", "--recipe", str(recipe)]
    cmd += ["--output-json", str(out), "--out", str(tmp_path)]
    env = {**os.environ, "COLUMNS": "200"}
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    ours, vllm_row = json.loads(out.read_text())["sides"]
    assert ours["status"] == "ok" and vllm_row["status"] == "unavailable"
    assert f"vLLM is not installed for {python}" in vllm_row["error"]
    assert "vllm: not run: vLLM is not installed" in res.stdout


def test_the_child_answers_each_generate_and_reports_failures(fake_vllm) -> None:
    source = resolve_model("tiny-llama", "dummy")
    prompts = [[1, 2, 3], [4, 5], [6]]
    with VLLMProcess(source, "float32", 0, fake_vllm) as peer:
        assert peer.version == "0.0.0+stand-in"
        assert peer.config["load_format"] == "dummy" and peer.config["skip_tokenizer_init"]
        for _ in range(2):  # loaded once, asked twice
            tokens, wall = peer.generate(prompts, [2, 3, 1], 0.0, ignore_eos=True)
            assert tokens == [[6, 7], [9, 10, 11], [6]] and wall >= 0
        assert peer.memory["bytes"] > 0 and peer.memory["kind"]
    failing = {"env": {**fake_vllm["env"], "FAKE_VLLM_FAIL": "generate"}}
    with VLLMProcess(source, "float32", 0, failing) as peer:
        with pytest.raises(RuntimeError, match="out of KV blocks"):
            peer.generate(prompts, [2, 3, 1], 0.0, ignore_eos=True)
        assert peer.proc.poll() is not None  # ended, not left running
    with pytest.raises(RuntimeError, match="vLLM: ValueError: no such model"):
        VLLMProcess(source, "float32", 0, {"env": {**fake_vllm["env"], "FAKE_VLLM_FAIL": "init"}})


def test_a_missing_interpreter_is_unavailable_not_a_crash(tmp_path: Path) -> None:
    source = resolve_model("tiny-llama", "dummy")
    with pytest.raises(PeerUnavailable, match="not installed for /nowhere/python"):
        VLLMProcess(source, "float32", 0, {"python": "/nowhere/python"})


def test_the_bench_compares_greedy_outputs_with_the_peer(fake_vllm, tmp_path: Path) -> None:
    from pagedctl.bench import report as bench_report
    from pagedctl.bench.recipe import load_bench_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "model: tiny-llama\nload_format: dummy\ndevice: cpu\nworkload:\n  num_requests: 4\n"
        "  prompt_len: [4, 8]\n  output_len: [2, 3]\n  token_ids: [0, 500]\n  temperature: 0\n"
    )
    spec = load_bench_recipe(recipe)
    spec.peers["vllm"] = fake_vllm
    doc = bench_report.run_bench(spec, ["vllm"], lambda line: None)
    ours, theirs = doc["sides"]
    assert theirs["status"] == "ok", theirs.get("error")
    assert theirs["output_tokens"] == ours["output_tokens"]
    assert theirs["config"]["version"] == "0.0.0+stand-in"
    assert theirs["peak_memory_kind"] == "peak RSS of the vLLM process"
    # tiny-llama's random weights answer otherwise than the stand-in's rule
    assert theirs["same_outputs_as_pagedctl"] == "0/4"
    assert all("_tokens" not in row for row in doc["sides"])  # compared, not kept
    assert "the same greedy tokens as pagedctl: 0/4" in bench_report.config_lines(doc)[1]


def test_bad_peer_settings_are_refused(tmp_path: Path) -> None:
    from pagedctl.bench.recipe import load_bench_recipe
    from pagedctl.recipe_file import RecipeError

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: tiny-llama\npeers:\n  vllm:\n    gpu_mem: 0.5\n")
    with pytest.raises(RecipeError, match="unknown peer vllm keys"):
        load_bench_recipe(recipe)


def test_the_chat_bench_alternates_a_third_side(fake_vllm, tmp_path: Path) -> None:
    """`pagedctl bench transformers --peer vllm`: the bundled model's folder (weights and
    tokenizer) goes to vLLM, and each repeat times all three sides."""
    from pagedctl.bench import transformers as bt

    lines = [
        {"custom_id": "a", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
        {
            "custom_id": "b",
            "messages": [{"role": "user", "content": "Name a sea."}],
            "max_tokens": 4,
        },
    ]
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = bt.run(prompts, device="cpu", hf_batch_size=2, repeats=2, vllm=fake_vllm)
    side = result["vllm"]
    assert len(side["wall_s_all"]) == 2 and side["output_tokens"] == 7  # never stops at EOS
    assert side["version"] == "0.0.0+stand-in" and side["load_format"] == "auto"
    assert side["tokenizer"] and not side["skip_tokenizer_init"]
    ratio = result["engine"]["output_tok_s"] / side["output_tok_s"]
    assert result["identical_outputs_vllm"] == 0
    assert result["ratio_vllm_output_tok_s"] == round(ratio, 3)
    assert result["identical_outputs"] == 2  # engine and transformers, as before


def test_the_chat_bench_refuses_a_peer_it_cannot_run(tmp_path: Path) -> None:
    def bench(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "pagedctl", "bench", "transformers", *args]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)

    for args, message in (
        (("--peer", "sglang"), "the one peer here is vllm"),
        (("--vllm-python", sys.executable), "needs --peer vllm"),
        (("--peer", "vllm", "--vllm-python", "/nowhere/python"), "not installed for /nowhere"),
    ):
        res = bench(*args)
        assert res.returncode != 0 and message in " ".join((res.stdout + res.stderr).split())


# Where vLLM lives in an interpreter of its own (it pins its own transformers).
VLLM_PYTHON = os.environ.get("PAGEDCTL_TEST_VLLM_PYTHON") or sys.executable


@pytest.mark.skipif(vllm_version(VLLM_PYTHON) is None, reason="vLLM is not installed here")
def test_real_vllm_gives_the_engines_greedy_tokens() -> None:  # pragma: no cover - not in CI
    """The real vLLM on the bundled model, float32: the engine's greedy tokens (as the chat
    bench found for all 32 of its prompts)."""
    from pagedctl import bundled_model
    from pagedctl.engine import LLM, SamplingParams

    prompts = [[1, 504, 3458, 282, 2135], [1, 339, 1173, 314]]
    llm = LLM(bundled_model(), device="cpu", dtype="float32", quantization="none")
    ours = [
        o.outputs[0].token_ids
        for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    ]
    source = resolve_model(str(bundled_model()))
    with VLLMProcess(source, "float32", 0, {"python": VLLM_PYTHON}, kv_cache_bytes=2**30) as peer:
        tokens, wall = peer.generate(prompts, [12, 12], 0.0, ignore_eos=False)
    assert tokens == [list(t) for t in ours] and wall > 0
