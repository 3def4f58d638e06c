"""README's first job on a loaded CPU at 1 and 2 threads and the automatic choice.

`python -m benchmarks.threads --out results` (results/cpu-threads.md, .json) from the repository
root. The job is README's first command, `pagedctl generate recipes/data/example.jsonl` on the
bundled SmolLM2-135M-Instruct with the default settings, shortened: the same 32 lines with each
`max_tokens` cut to `--max-tokens` (16: 568 of the 1,728 output tokens; 0 keeps the job whole),
because at 2 threads beside a busy process the whole job runs for a quarter of an hour.

Under each background load of `--loads` busy processes (pure-Python spin loops, started before
and stopped after the runs of that load), each thread count runs as its own `pagedctl generate`
process with OMP_NUM_THREADS and MKL_NUM_THREADS unset, on a fresh output; the order of the
thread counts is reversed every other repeat, and the loads alternate too, so that a change in
what else runs on the machine falls on every count alike. The figure is the summary's output
tok/s (model loading excluded). A run still going `--job-limit` seconds after its engine started
is stopped: its tok/s is below the job's output tokens over that time, shown as "< X". Per load:
the median of each count, and the automatic choice's median over the best fixed count's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INPUT = ROOT / "recipes" / "data" / "example.jsonl"
COUNTS = ("1", "2", "auto")
TARGET = 1.3  # done when the automatic choice runs within 1.3x of the best fixed count


def shorten(src: Path, dst: Path, cap: int) -> int:
    """`src` with every line's max_tokens cut to `cap` (0: as it is); returns its lines."""
    lines = src.read_text(encoding="utf-8").splitlines()
    with dst.open("w", encoding="utf-8") as f:
        for line in lines:
            d = json.loads(line)
            body = d.get("body", d)
            if cap:
                body["max_tokens"] = min(body.get("max_tokens", cap), cap)
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    return len(lines)


def spinners(n: int) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    time.sleep(1.0)  # running before the job's engine measures the load
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def run_job(job: Path, threads: str, limit_s: float, work: Path) -> dict:
    """One `pagedctl generate` process; its summary's figures and the thread count it took."""
    work.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pagedctl", "generate", str(job), "-o", str(work / "out.jsonl")]
    cmd += ["--errors", str(work / "errors.jsonl"), "--summary-json", str(work / "summary.json")]
    if threads != "auto":
        cmd += ["--threads", threads]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    start = time.monotonic()
    seen: dict = {"ready": None, "chosen": None, "tail": []}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )

    def read() -> None:
        for line in proc.stderr:
            if "CPU threads:" in line:
                seen["chosen"] = line.split("CPU threads:", 1)[1].strip()
            if "maximum concurrency" in line and seen["ready"] is None:
                seen["ready"] = time.monotonic()
            seen["tail"] = [*seen["tail"][-9:], line.rstrip()]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    timed_out = False
    while proc.poll() is None:
        time.sleep(0.2)
        ready = seen["ready"]
        if time.monotonic() - (ready or start) > (limit_s if ready else limit_s + 180):
            proc.kill()
            proc.wait()
            timed_out = True
    reader.join(timeout=5)
    row = {
        "threads": threads,
        "chosen": seen["chosen"],
        "startup_s": round((seen["ready"] or time.monotonic()) - start, 2),
        "timed_out": timed_out,
        "exit_code": proc.returncode,
    }
    if timed_out:
        row["ran_s"] = round(time.monotonic() - (seen["ready"] or start), 2)
        return row
    try:
        summary = json.loads((work / "summary.json").read_text())
    except (OSError, ValueError):
        raise RuntimeError("the job wrote no summary:\n" + "\n".join(seen["tail"])) from None
    row.update(
        output_tok_s=summary["output_tok_per_s"],
        output_tokens=summary["output_tokens"],
        wall_s=summary["wall_s"],
    )
    return row


def loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def figures(rows: list[dict]) -> dict:
    """Per load: each count's median tok/s (an upper bound where a run timed out) and the ratio
    of the automatic choice to the best fixed count."""
    tokens = max((r["output_tokens"] for r in rows if "output_tokens" in r), default=0)
    for r in rows:
        if r["timed_out"]:
            r["output_tok_s_below"] = round(tokens / r["ran_s"], 2) if tokens else None
    out = {}
    for load in sorted({r["load"] for r in rows}):
        per = {}
        for count in COUNTS:
            mine = [r for r in rows if r["load"] == load and r["threads"] == count]
            vals = [r.get("output_tok_s", r.get("output_tok_s_below")) for r in mine]
            vals = [v for v in vals if v is not None]
            per[count] = {
                "median_tok_s": round(statistics.median(vals), 2) if vals else None,
                "upper_bound": any(r["timed_out"] for r in mine),
                "runs": vals,
                "chosen": sorted({r["chosen"] for r in mine if r["chosen"]}),
            }
        best = max(("1", "2"), key=lambda c: per[c]["median_tok_s"] or 0.0)
        auto = per["auto"]["median_tok_s"]
        ratio = auto / per[best]["median_tok_s"] if auto and per[best]["median_tok_s"] else None
        took = [
            (r["chosen"] or "").split(" ", 1)[0]
            for r in rows
            if r["load"] == load and r["threads"] == "auto"
        ]
        out[str(load)] = {
            "counts": per,
            "best_fixed": best,
            "auto_took_best": [sum(t == best for t in took), len(took)],
            "auto_over_best": round(ratio, 3) if ratio else None,
            "within_target": ratio is not None and ratio >= 1 / TARGET,
        }
    return out


def markdown(result: dict) -> str:
    a, env = result["args"], result["environment"]
    job = "whole" if not a["max_tokens"] else f"each line's max_tokens cut to {a['max_tokens']}"
    lines = [
        "# cpu-threads",
        "",
        "README's first job (`pagedctl generate recipes/data/example.jsonl`, the bundled "
        f"SmolLM2-135M-Instruct, default settings; {job}) at 1 and 2 CPU threads and the "
        "automatic choice (`--threads` left out), beside busy processes (pure-Python spin "
        'loops). Output tok/s from the job\'s summary (model loading excluded); "< X": stopped '
        f"after {a['job_limit']:g} s, below X.",
        "",
        f"Regenerate: `{result['command']}`",
        "",
        f"Ran on {env['cpu']} ({env['cpu_count']} CPUs, shared with other work); torch "
        f"{env['torch']}; pagedctl {env['pagedctl']} commit {env['commit']}; {env['date']}. "
        f"{a['repeats']} repeats, the order of the counts reversed every other one; "
        f"{result['wall_s']:.0f} s in all.",
        "",
        "| busy processes | threads | took | out tok/s (runs) | load avg before | median "
        "| auto ÷ best fixed |",
        "|---:|---|---|---|---|---:|---:|",
    ]
    for load, f in result["figures"].items():
        for count in COUNTS:
            c = f["counts"][count]
            mine = [r for r in result["runs"] if _is(r, load, count)]
            runs = ", ".join(_tok(r) for r in mine)
            avg = ", ".join(f"{r['loadavg_before']:.1f}" for r in mine if r["loadavg_before"])
            med = c["median_tok_s"]
            shown = "-" if med is None else (f"< {med:.1f}" if c["upper_bound"] else f"{med:.1f}")
            took = ", ".join(x.split(" ", 1)[0] for x in c["chosen"]) or count
            ratio = f["auto_over_best"]
            last = f"{ratio:.2f}x (best: {f['best_fixed']})" if count == "auto" and ratio else ""
            lines.append(f"| {load} | {count} | {took} | {runs} | {avg} | {shown} | {last} |")
    reasons = sorted({r["chosen"] for r in result["runs"] if r["threads"] == "auto"})
    lines += ["", "The automatic choice's log lines: " + "; ".join(f"`{x}`" for x in reasons)]
    verdict = all(f["within_target"] for f in result["figures"].values())
    took = "; ".join(
        f"{load} busy: {f['auto_took_best'][0]} of {f['auto_took_best'][1]}"
        for load, f in result["figures"].items()
    )
    lines += [
        "",
        f"Within {TARGET}x of the best fixed count under every load: {'yes' if verdict else 'no'}. "
        f"Runs in which the automatic choice took the best fixed count: {took}. Such a run and "
        "the fixed count's differ only by what else ran on the machine at the time (the load "
        "average before each run, which counts the busy processes and this job's own threads).",
        "",
    ]
    return "\n".join(lines)


def _shown_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _is(r: dict, load: str, count: str) -> bool:
    return str(r["load"]) == load and r["threads"] == count


def _tok(r: dict) -> str:
    if r["timed_out"]:
        below = r.get("output_tok_s_below")
        return f"< {below:.1f}" if below is not None else "stopped"
    return f"{r['output_tok_s']:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loads", default="1,2", help="busy processes, comma-separated")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=16, help="cut every line's (0: keep)")
    p.add_argument("--job-limit", type=float, default=45.0, help="seconds of one run's job")
    p.add_argument("--out", type=Path, default=ROOT / "results")
    p.add_argument("--name", default="cpu-threads")
    p.add_argument("--render", type=Path, help="redraw the Markdown of a JSON result; run nothing")
    a = p.parse_args()
    if a.render:
        result = json.loads(a.render.read_text())
        result["figures"] = figures(result["runs"])
        a.render.write_text(json.dumps(result, indent=1) + "\n")
        a.render.with_suffix(".md").write_text(markdown(result))
        return
    from pagedctl.envinfo import environment

    loads = [int(x) for x in a.loads.split(",")]
    began, rows = time.monotonic(), []
    with tempfile.TemporaryDirectory(prefix="pagedctl-threads-") as tmp:
        job = Path(tmp) / "job.jsonl"
        shorten(INPUT, job, a.max_tokens)
        for rep in range(a.repeats):
            for load in loads if rep % 2 == 0 else loads[::-1]:
                busy = spinners(load)
                try:
                    for count in COUNTS if rep % 2 == 0 else COUNTS[::-1]:
                        row = {"load": load, "repeat": rep, "loadavg_before": loadavg()}
                        row.update(run_job(job, count, a.job_limit, Path(tmp) / f"{len(rows)}"))
                        rows.append(row)
                        print(
                            f"load {load} threads {count:>4} (took {row['chosen']}): "
                            + (
                                f"stopped after {row['ran_s']:.0f} s"
                                if row["timed_out"]
                                else f"{row['output_tok_s']:.1f} out tok/s"
                            ),
                            flush=True,
                        )
                finally:
                    stop(busy)
    cmd = (
        "python -m benchmarks.threads"
        + "".join(
            f" --{k.replace('_', '-')} {v}"
            for k, v in (("loads", a.loads), ("repeats", a.repeats), ("max_tokens", a.max_tokens))
        )
        + (f" --name {a.name}" if a.name != "cpu-threads" else "")
    )
    result = {
        "benchmark": "CPU threads of README's first job under background load",
        "command": f"{cmd} --out {_shown_path(a.out)}",
        "environment": environment(),
        "args": {
            "loads": loads,
            "repeats": a.repeats,
            "max_tokens": a.max_tokens,
            "job_limit": a.job_limit,
        },
        "wall_s": round(time.monotonic() - began, 1),
        "runs": rows,
    }
    result["figures"] = figures(rows)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{a.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (a.out / f"{a.name}.md").write_text(markdown(result))
    for load, f in result["figures"].items():
        print(f"load {load}: auto / best fixed ({f['best_fixed']}) = {f['auto_over_best']}")


if __name__ == "__main__":
    main()
