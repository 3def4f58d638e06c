"""`pagedctl generate` against the engine it drives, on the same requests: `python3
scripts/device/job_vs_engine.py OUT_DIR [MODEL]` (MODEL: a .gguf or folder; default the bundled
SmolLM2-135M-Instruct).

W1's requests (256, prompts of U[100, 1024] token ids in [0, 10000), `max_tokens` U[100, 1024],
EOS ignored, temperature 0.6, seed 0) once as a JSONL job of `prompt_token_ids` lines run by
`python3 -m pagedctl generate` in a child process (its summary's wall: model loading and graph
capture excluded; reading, validating, writing and fsyncing the records included), and once
through `engine.LLM.generate` in this process after a warm-up, as `pagedctl bench` times it. Then
the bundled example's 32 chat and completion lines repeated 64 times (2,048 lines of text:
tokenizer, chat template, detokenizer) as a job only. `JOB_REQUESTS=N` shrinks both sets for a
smoke run on the CPU.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
N = int(os.environ.get("JOB_REQUESTS", 256))


def w1_lines() -> list[dict]:
    rng = random.Random(0)
    lines = []
    for i in range(N):
        prompt = [rng.randrange(10000) for _ in range(rng.randint(100, 1024))]
        lines.append(
            {
                "custom_id": f"w1-{i}",
                "prompt_token_ids": prompt,
                "max_tokens": rng.randint(100, 1024) if N >= 64 else 8,
                "ignore_eos": True,
                "temperature": 0.6,
            }
        )
    return lines


def run_job(name: str, lines: list[dict], out: Path, model: str | None) -> dict:
    src = out / f"{name}.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cmd = [sys.executable, "-m", "pagedctl", "generate", str(src), "-o", str(out / f"{name}.out")]
    cmd += ["--errors", str(out / f"{name}.err"), "--summary-json", str(out / f"{name}.json")]
    cmd += ["--model", model] if model else []
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    summary = json.loads((out / f"{name}.json").read_text())
    summary["process_wall_s"] = round(time.perf_counter() - t, 2)
    summary["exit_code"] = done.returncode
    (out / f"{name}.log").write_text(done.stdout[-4000:] + done.stderr[-4000:])
    return summary


def run_engine(lines: list[dict], model: str | None) -> dict:
    from engine import SamplingParams
    from engine.llm import LLM

    llm = LLM(model)
    warm = SamplingParams(temperature=0.6, max_tokens=4, ignore_eos=True)
    llm.generate([list(range(1, 9))] * 2, warm)
    params = [
        SamplingParams(temperature=0.6, max_tokens=line["max_tokens"], ignore_eos=True)
        for line in lines
    ]
    t = time.perf_counter()
    outs = llm.generate([line["prompt_token_ids"] for line in lines], params)
    wall = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs if o.ok)
    return {"wall_s": round(wall, 3), "output_tokens": tokens, "output_tok_per_s": tokens / wall}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    model = sys.argv[2] if len(sys.argv) > 2 else None
    lines = w1_lines()
    result = {"w1_job": run_job("w1", lines, out, model)}
    print("w1 job", json.dumps(result["w1_job"]), flush=True)
    example_file = ROOT / "recipes/data/example.jsonl"
    example = [json.loads(s) for s in example_file.read_text().splitlines()]
    chat = []
    for rep in range(max(1, N // 4)):
        for line in example:
            line = dict(line)
            key = "custom_id" if "custom_id" in line else "id"
            line[key] = f"{line[key]}-{rep}"
            chat.append(line)
    result["chat_job"] = run_job("chat", chat, out, model)
    print("chat job", json.dumps(result["chat_job"]), flush=True)
    # last: this process keeps the engine's memory, which a child job started after it would lack
    result["w1_engine"] = run_engine(lines, model)
    print("w1 engine", json.dumps(result["w1_engine"]), flush=True)
    (out / "job_vs_engine.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
