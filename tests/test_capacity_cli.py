"""`pagedctl capacity` end to end: the real CLI in a subprocess, its files, its errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pagedctl.cli import app

REPO = Path(__file__).resolve().parent.parent
T4_RECIPE = REPO / "recipes" / "capacity-t4.yaml"


def capacity(*args: str | Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "160"}
    cmd = [sys.executable, "-m", "pagedctl", "capacity", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def invoke(*args: str | Path) -> tuple[int, str]:
    """The same command in this process (quicker than a subprocess): exit code, stdout + stderr."""
    r = CliRunner().invoke(app, ["capacity", *map(str, args)])
    return r.exit_code, r.output + (r.stderr if r.stderr_bytes else "")


def result(out: Path, name: str) -> dict:
    return json.loads((out / f"capacity-{name}.json").read_text())


def test_the_t4_recipe_reproduces_vllms_t4_figures(tmp_path: Path) -> None:
    p = capacity("--recipe", T4_RECIPE, "--requests", "40000", "--out", tmp_path)
    assert p.returncode == 0, p.stderr
    doc = result(tmp_path, "t4")
    compare = doc["sections"]["compare"]
    assert len(compare) >= 25
    bad = [(r["label"], r["reference"], r["ours"]) for r in compare if r["ok"] != "yes"]
    assert not bad, bad
    for suffix in ("pool", "lengths", "blocks", "sim", "compare"):
        assert (tmp_path / f"capacity-t4-{suffix}.csv").read_text().count("\n") > 1
    md = (tmp_path / "capacity-t4.md").read_text()
    assert "## Reference figures beside ours" in md and "Interpretation:" in md
    assert doc["environment"]["pagedctl"] and doc["command"].startswith("pagedctl capacity")
    assert "Reference figures beside ours" in p.stdout


def test_the_t4_block_count_gives_vllms_counts_exactly(tmp_path: Path) -> None:
    args = ["--recipe", T4_RECIPE, "--num-blocks", "58064", "--no-sim", "--name", "exact"]
    code, out = invoke(*args, "--out", tmp_path)
    assert code == 0, out
    doc = result(tmp_path, "exact")
    paged = {r["seq_len"]: r["paged"] for r in doc["sections"]["lengths"]}
    assert [paged[n] for n in (2048, 512, 256, 128)] == [453, 1814, 3629, 7258]
    assert doc["figures"]["kv_tokens"] == 929_024
    assert "Maximum concurrency for 2,048 tokens per request: 453.62x" in out


def _tokenizer_model(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir()
    (folder / "config.json").write_text(
        (REPO / "engine/models/presets" / "tiny-llama.json").read_text()
    )
    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", "hello", "paged", "world"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(folder)
    return folder


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


JOB = [
    {"custom_id": "a", "prompt": "hello world paged", "max_tokens": 10},
    {"custom_id": "b", "prompt_token_ids": [1, 2, 3, 4, 5], "max_tokens": 20},
    {
        "custom_id": "c",
        "messages": [{"role": "user", "content": "hello hello"}],
        "max_tokens": 5,
        "n": 2,
    },
    "this line is not JSON",
]


def test_lengths_from_a_job_tokenized_and_from_its_outputs(tmp_path: Path) -> None:
    model = _tokenizer_model(tmp_path / "m")
    job = _jsonl(tmp_path / "in.jsonl", JOB)
    common = ["--model", model, "--num-blocks", "64", "--max-len", "64", "--out", tmp_path]
    p = capacity(*common, "--lengths", job, "--requests", "2000", "--loads", "0.5", "--name", "j")
    assert p.returncode == 0, p.stderr
    doc = result(tmp_path, "j")
    # prompts 3, 5 and 2 (x2 samples) tokens; outputs 10, 20, 5, 5: lengths 13, 25, 7, 7
    assert doc["sections"]["blocks"][0]["mean_len"] == pytest.approx(52 / 4)
    assert "1 invalid lines of in.jsonl left out" in p.stdout
    assert {r["allocator"] for r in doc["sections"]["sim"]} == {"reservation", "exact", "paged"}
    outputs = _jsonl(
        tmp_path / "in.out.jsonl",
        [
            {
                "custom_id": "a",
                "error": None,
                "response": {
                    "body": {"choices": [{}], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}
                },
            },
            {"custom_id": "c", "response": None, "error": {"code": "x", "message": "y"}},
        ],
    )
    code, out = invoke(*common, "--lengths", job, "--outputs", outputs, "--no-sim", "--name", "o")
    assert code == 0, out
    # a really produced 4 tokens (3 + 4 = 7); c failed, so its max_tokens stand: 7, 25, 7, 7
    assert result(tmp_path, "o")["sections"]["blocks"][0]["mean_len"] == pytest.approx(46 / 4)
    assert "1 of 3 requests took their lengths from in.out.jsonl" in out


def test_without_a_tokenizer_prompts_are_estimated(tmp_path: Path) -> None:
    job = _jsonl(tmp_path / "in.jsonl", JOB[:1])
    code, out = invoke(
        "--model",
        "tiny-llama",
        "--num-blocks",
        "64",
        "--max-len",
        "64",
        "--lengths",
        job,
        "--no-sim",
        "--out",
        tmp_path,
        "--name",
        "e",
    )
    assert code == 0, out
    assert "estimated at 4 UTF-8 bytes per token" in out
    # "hello world paged" is 17 bytes: ceil(17 / 4) = 5 prompt tokens + 10 output
    assert result(tmp_path, "e")["sections"]["blocks"][0]["mean_len"] == 15


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "no-such-model"], "not found"),
        (["--model", "tiny-llama", "--gpu", "v100"], "presets: t4"),
        (
            ["--model", "tiny-llama", "--gpu", "t4", "--dist", "lognormal:mean=1,median=5"],
            "mean exceeds its median",
        ),
        (["--model", "tiny-llama", "--gpu", "t4", "--outputs", "x.jsonl"], "needs --lengths"),
        (["--model", "tiny-llama", "--gpu", "t4", "--lengths", "missing.jsonl"], "cannot read"),
        (["--model", "tiny-llama", "--gpu", "t4", "--gpu-mem", "1.5"], "(0, 1]"),
        (["--model", "qwen3-0.6b", "--device-memory", "1GiB"], "no KV block fits"),
        (["--gpu", "t4"], "name a model"),
    ],
)
def test_bad_input_is_one_clear_error(tmp_path: Path, args: list[str], message: str) -> None:
    code, out = invoke(*args, "--out", tmp_path)
    assert code == 64
    assert message in out


def test_bad_input_in_a_real_process_has_no_traceback(tmp_path: Path) -> None:
    p = capacity("--model", "no-such-model", "--gpu", "t4", "--out", tmp_path)
    assert p.returncode == 64 and p.stderr.startswith("error: model 'no-such-model' not found")
    assert "Traceback" not in p.stderr and not list(tmp_path.iterdir())


def test_recipe_with_an_unknown_key_is_refused(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: tiny-llama\ngpu: t4\nblock_sizes: [16]\n")
    code, out = invoke("--recipe", recipe, "--out", tmp_path)
    assert code == 64 and "unknown keys ['block_sizes']" in out


def test_the_step_graphs_pool_counts_unless_graphs_are_off(tmp_path: Path) -> None:
    base = ["--model", "qwen2.5-0.5b-instruct", "--gpu", "t4", "--no-sim", "--out", tmp_path]
    code, out = invoke(*base, "--name", "graphs")
    assert code == 0, out
    code, out = invoke(*base, "--no-cuda-graphs", "--name", "eager")
    assert code == 0, out
    graphs, eager = result(tmp_path, "graphs"), result(tmp_path, "eager")
    assert "+ CUDA-graph reserve" in " ".join(graphs["header"])
    assert "no CUDA-graph reserve" in " ".join(eager["header"])
    assert "--no-cuda-graphs" in eager["command"]
    mem_g, mem_e = graphs["memory"], eager["memory"]
    assert mem_g["graph_reserve_bytes"] == mem_g["activation_peak_bytes"] > 0
    assert mem_e["graph_reserve_bytes"] == 0
    assert mem_g["non_kv_bytes"] - mem_e["non_kv_bytes"] == mem_g["graph_reserve_bytes"]
    blocks = [d["sections"]["pool"][0]["num_blocks"] for d in (graphs, eager)]
    assert blocks[0] < blocks[1]
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: tiny-llama\ngpu: t4\ncuda_graphs: maybe\n")
    code, out = invoke("--recipe", recipe, "--out", tmp_path)
    assert code == 64 and "cuda_graphs: expected true or false" in out


def test_plot_writes_charts(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    code, out = invoke(
        "--model",
        "qwen2.5-0.5b-instruct",
        "--gpu",
        "t4",
        "--max-len",
        "2048",
        "--dist",
        "lognormal:mean=260,median=180",
        "--requests",
        "2000",
        "--loads",
        "0.5,1",
        "--plot",
        "--out",
        tmp_path,
        "--name",
        "p",
    )
    assert code == 0, out
    for chart in ("capacity", "refusals"):
        assert (tmp_path / f"capacity-p-{chart}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['matplotlib'] = None; sys.argv = ['pagedctl', 'capacity', "
        f"'--model', 'tiny-llama', '--gpu', 't4', '--plot', '--out', {str(tmp_path)!r}]; "
        "from pagedctl.cli import main; main()"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 64 and "pip install 'pagedctl[plot]'" in p.stderr


def test_bench_command_writes_its_figure(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(app, ["bench", "capacity-sim", "--requests", "5000", "-o", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["requests"] == 5000 and doc["environment"]["python"]
    assert doc["total_s"] > 0 and len(doc["results"]) == 3


def test_quantization_shrinks_the_weights_and_grows_the_pool(tmp_path: Path) -> None:
    """`--quantization int4/int8` count the projections' packed bytes (the engine's own
    estimate, `planned_weights_bytes`), and the pool gets what they free; `auto` on a 16-bit
    config is `none`; a config that is already quantized is refused int4 by name, and `auto`
    keeps its integers on a card too small for its floats."""
    base = ["--model", "qwen2.5-0.5b-instruct", "--gpu", "t4", "--no-sim", "--out", tmp_path]
    docs = {}
    for q in ("auto", "int8", "int4"):
        code, out = invoke(*base, "--quantization", q, "--name", q)
        assert code == 0, out
        docs[q] = result(tmp_path, q)
    mem = {q: d["memory"] for q, d in docs.items()}
    assert mem["auto"]["quantization"] == "none" and mem["int4"]["quantization"] == "int4"
    w = {q: m["weights_bytes"] for q, m in mem.items()}
    assert w["int4"] < w["int8"] < w["auto"]
    blocks = {q: d["sections"]["pool"][0]["num_blocks"] for q, d in docs.items()}
    assert blocks["auto"] < blocks["int8"] < blocks["int4"]
    assert "(quantization int4)" in " ".join(docs["int4"]["header"])
    code, out = invoke(*base, "--quantization", "int3")
    assert code == 64 and "one of auto, checkpoint, none, int8, int4" in out

    from pagedctl.engine import list_presets

    config = json.loads(Path(list_presets()["llama-3.2-1b"]).read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                     "desc_act": False, "sym": True}  # fmt: skip
    gptq = tmp_path / "gptq.json"
    gptq.write_text(json.dumps(config))
    card = ["--model", gptq, "--no-sim", "--out", tmp_path]
    code, out = invoke(*card, "--device-memory", "4GiB", "--name", "small")
    assert code == 0, out
    code, out = invoke(*card, "--device-memory", "80GiB", "--name", "large")
    assert code == 0, out
    small, large = result(tmp_path, "small")["memory"], result(tmp_path, "large")["memory"]
    assert (small["quantization"], large["quantization"]) == ("gptq", "none")
    assert small["weights_bytes"] < 0.5 * large["weights_bytes"]  # embeddings stay 16-bit
    code, out = invoke(*card, "--device-memory", "4GiB", "--quantization", "int4")
    assert code == 64 and "already quantized (gptq)" in out


def test_a_sliding_window_caps_what_a_long_sequence_holds(tmp_path: Path) -> None:
    """Mistral-7B v0.1 (a 4,096-token window on every layer): at 16K tokens a paged sequence
    holds its window's blocks and one more, a contiguous one a window-long ring buffer; the same
    config without the window holds every token."""
    from pagedctl.engine.sizing.kv import blocks_held

    assert blocks_held(10_000, 16, 4096) == 625 - (10_000 - 4096) // 16 == 256
    assert blocks_held(100, 16, 4096) == blocks_held(100, 16) == 7
    config = {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
        "sliding_window": 4096, "torch_dtype": "bfloat16",
    }  # fmt: skip
    docs = {}
    for name, window in (("window", 4096), ("full", None)):
        path = tmp_path / f"config-{name}.json"
        path.write_text(json.dumps({**config, "sliding_window": window}))
        args = ["--model", path, "--gpu", "a100-80g", "--max-len", "16384", "--no-sim"]
        code, out = invoke(*args, "--block-size", "16", "--out", tmp_path, "--name", name)
        assert code == 0, out
        docs[name] = result(tmp_path, name)
    rows = {k: {r["seq_len"]: r for r in d["sections"]["lengths"]} for k, d in docs.items()}
    pool = docs["window"]["sections"]["pool"][0]
    per_seq = 16 * 2 * 32 * 8 * 128 * 2  # a block's bytes: 16 tokens x K and V x layers x heads
    assert rows["window"][16384]["paged"] == pool["num_blocks"] // blocks_held(16384, 16, 4096)
    assert rows["full"][16384]["paged"] == pool["num_blocks"] // 1024
    assert rows["window"][16384]["paged"] > 3 * rows["full"][16384]["paged"]
    assert rows["window"][4096]["paged"] == rows["full"][4096]["paged"]
    ring = pool["kv_budget_bytes"] // (4096 * per_seq // 16)
    assert rows["window"][16384]["contiguous_same_budget"] == ring
    assert rows["full"][16384]["contiguous_same_budget"] == ring // 4


def test_max_len_past_the_model_positions_is_refused(tmp_path: Path) -> None:
    """Phi-3-mini has 4,096 positions: planning for 8,192-token sequences is a bad flag."""
    args = ["--model", "phi-3-mini", "--gpu", "t4", "--max-len", "8192", "--no-sim"]
    code, out = invoke(*args, "--out", tmp_path)
    assert code == 64, out  # a bad flag's exit code
    assert "--max-len 8192 exceeds the model's 4096 positions" in " ".join(out.split())
    assert not list(tmp_path.iterdir())  # refused before anything was written
