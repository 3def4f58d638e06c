"""`pagedctl generate --replicas N` on a real local Ray cluster, and `build_processor`.

The test process starts the cluster (`ray.init(num_cpus=4)`: two replicas of one logical CPU and
room for the pipeline on two cores) and each job joins it with `--ray-address`, so a job killed
with SIGKILL takes only its own actors with it. The model is the dummy-weight tiny-llama preset
in float32, whose greedy answers do not depend on what ran beside them, so a scaled-out job's
records must equal a one-process job's token for token.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedctl.exits import EXIT_OK, EXIT_PARTIAL, EXIT_TEMPFAIL, EXIT_USAGE
from tests.job_utils import answer_tokens, read_jsonl, wait_for_lines, write_jsonl

# A local cluster with token authentication, as Ray starts one by default; the jobs
# (subprocesses) join it with the token from the environment. Set before Ray is imported: Ray
# reads its authentication mode once.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
ray = pytest.importorskip("ray")

from pagedctl.engine.scale_out.ray_data import build_processor  # noqa: E402
from pagedctl.engine.scale_out.ray_replica import Ledger  # noqa: E402

MODEL = ["--model", "tiny-llama", "--temperature", "0", "--ignore-eos", "--max-num-seqs", "32"]
N = 160


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def cmd(*args) -> list[str]:
    return [sys.executable, "-m", "pagedctl", "generate", *map(str, args)]


def gen(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd(*args), capture_output=True, text=True, timeout=timeout, env=_env())


# Every third line is also penalized, biased and asks for top and prompt logprobs: the replicas
# carry those fields as one process does.
SHAPED = {"frequency_penalty": 0.5, "repetition_penalty": 1.2, "logit_bias": {"5": 3},
          "min_tokens": 4, "prompt_logprobs": 1, "logprobs": 2}  # fmt: skip


def lines(n: int = N, max_tokens: int = 96) -> list[dict]:
    return [
        {
            "custom_id": f"r{i:03d}",
            "prompt_token_ids": [1, 7 + i % 50, 30 + i % 90, 2 + i % 13],
            "max_tokens": max_tokens,
            "logprobs": True,  # the model has no tokenizer: its tokens show as ids there
            **(SHAPED if i % 3 == 0 else {}),
        }
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def cluster():
    ctx = ray.init("local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ctx.address_info["gcs_address"]
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, list]:
    """The same lines as a one-process job."""
    d = tmp_path_factory.mktemp("one")
    src = write_jsonl(d / "in.jsonl", lines())
    r = gen(src, *MODEL, "-q")
    assert r.returncode == EXIT_OK, r.stderr
    return answer_tokens(d / "in.out.jsonl")


def test_two_replicas_answer_as_one_process_and_keep_per_line_errors(cluster, reference, tmp_path):
    bad = ["{not json", {"custom_id": "huge-id", "prompt_token_ids": [1, 10**9], "max_tokens": 4}]
    src = write_jsonl(tmp_path / "in.jsonl", [*lines()[:80], *bad, *lines()[80:]])
    summary = tmp_path / "summary.json"
    r = gen(src, *MODEL, "--replicas", "2", "--ray-address", cluster, "--log-format", "json",
            "--summary-json", summary)  # fmt: skip
    assert r.returncode == EXIT_PARTIAL, r.stderr
    for line in r.stderr.splitlines():  # a JSON log stays JSON with Ray in the process
        json.loads(line)
    assert answer_tokens(tmp_path / "in.out.jsonl") == reference
    errors = {e["custom_id"]: e for e in read_jsonl(tmp_path / "in.errors.jsonl")}
    assert set(errors) == {None, "huge-id"}, errors
    assert errors["huge-id"]["error"]["code"] == "token_out_of_vocab"
    s = json.loads(summary.read_text())
    assert (s["ok"], s["failed"], s["in_flight_abandoned"]) == (N, 2, 0)
    assert sum(p["requests"] for p in s["replicas"]) == N + 1  # the refused one came back too
    assert len(s["replicas"]) == 2, s["replicas"]  # both replicas took batches
    assert s["output_tokens"] == sum(p["output_tokens"] for p in s["replicas"])

    again = gen(src, *MODEL, "--replicas", "2", "--ray-address", cluster, "-q")  # all done
    assert again.returncode == EXIT_PARTIAL, again.stderr
    assert answer_tokens(tmp_path / "in.out.jsonl") == reference


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_driver_stopped_mid_job_resumes_exactly_once(cluster, reference, tmp_path, sig):
    """SIGKILL loses the batches in flight; SIGTERM too, but ends with 75 (Ray's own SIGTERM
    handler, set when it starts, must not be the one that runs)."""
    src = write_jsonl(tmp_path / "in.jsonl", lines())
    out = tmp_path / "in.out.jsonl"
    args = [src, *MODEL, "--replicas", "2", "--ray-address", cluster, "-q"]
    proc = subprocess.Popen(cmd(*args), stderr=subprocess.PIPE, text=True, env=_env())
    seen = wait_for_lines(out, 16, proc, timeout=240)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert 16 <= seen < N, f"the signal came after {seen} of {N} lines"
    if sig == signal.SIGTERM:
        assert proc.returncode == EXIT_TEMPFAIL and "stopped by SIGTERM" in err, err
    r = gen(*args)
    assert r.returncode == EXIT_OK, r.stderr
    assert answer_tokens(out) == reference  # every custom_id once, the same answers


def _replica_pids() -> list[int]:
    """The processes of the replica actors (Ray names them after the class)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            args = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"EngineReplica" in args and b"ray::" in args:
            pids.append(int(entry.name))
    return pids


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _cpu_used(pids: list[int], seconds: float = 0.3) -> dict[int, int]:
    """Each process's CPU ticks over the next `seconds`."""
    before = {p: _cpu_ticks(p) for p in pids}
    time.sleep(seconds)
    return {p: _cpu_ticks(p) - before[p] for p in pids}


def _busiest(pids: list[int]) -> int:
    used = _cpu_used(pids)
    return max(pids, key=used.__getitem__)


def _batches_running(timeout: float = 60.0) -> None:
    """Wait until the job's ledger has requests running on a replica, so that killing every
    replica kills a batch: on a loaded machine the replicas can sit between batches, waiting for
    the driver to feed them, for seconds."""
    from pagedctl.engine.scale_out.ray_data import LEDGER_NAME

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for actor in ray.util.list_named_actors(all_namespaces=True):
            if not actor["name"].startswith(LEDGER_NAME):
                continue
            with contextlib.suppress(ValueError, ray.exceptions.RayError):  # an earlier job's
                ledger = ray.get_actor(actor["name"], namespace=actor["namespace"])
                if ray.get(ledger.running_count.remote(), timeout=5) > 0:
                    return
        time.sleep(0.05)
    pytest.fail(f"no batch ran on a replica within {timeout:.0f} s")


@pytest.mark.parametrize("kill", ["one", "both"])
def test_replicas_killed_mid_job_are_restarted_and_nothing_is_lost(
    cluster, reference, tmp_path, kill
):
    src = write_jsonl(tmp_path / "in.jsonl", lines())
    out, summary = tmp_path / "in.out.jsonl", tmp_path / "summary.json"
    args = [src, *MODEL, "--replicas", "2", "--ray-address", cluster, "-q",
            "--summary-json", summary]  # fmt: skip
    proc = subprocess.Popen(cmd(*args), stderr=subprocess.PIPE, text=True, env=_env())
    seen = wait_for_lines(out, 16, proc, timeout=240)
    pids = _replica_pids()
    assert len(pids) == 2 and seen < N, (pids, seen)
    if kill == "both":
        _batches_running()
    for pid in [_busiest(pids)] if kill == "one" else pids:
        os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_OK, err
    assert answer_tokens(out) == reference  # every custom_id once, the same answers
    s = json.loads(summary.read_text())
    assert s["ok"] == N and s["in_flight_abandoned"] == 0, s
    if kill == "both":  # the batches they held ran again, each death charged to its requests
        assert s["replica_deaths"] >= 1, s
        assert len(s["replicas"]) >= 3, s["replicas"]  # a restarted replica is a new process


def test_bad_scale_out_flags_are_refused_before_anything_runs(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", lines(2))
    for args, says in (
        (["--replicas", "0"], "--replicas"),
        (["--ray-address", "auto"], "--ray-address needs --replicas"),
    ):
        r = gen(src, "--model", "no-such-model-is-ever-loaded", *args)
        assert r.returncode == EXIT_USAGE and says in r.stderr, r.stderr
        assert not (tmp_path / "in.out.jsonl").exists()


def test_a_replica_pool_is_an_engine_with_a_replica_table(cluster):
    from pagedctl.engine import Engine, ReplicaPool, Replicas

    pool = ReplicaPool({"model": "tiny-llama", "device": "cpu"}, 2, cluster)
    try:
        assert isinstance(pool, Engine) and isinstance(pool.replicas, Replicas)
        assert (pool.model_name, pool.source.name, pool.tokenizer) == ("tiny-llama",) * 2 + (None,)
        assert pool.startup is None  # its replicas load inside the run
        assert (pool.replicas.size, pool.replicas.shares(), pool.snapshots()) == (2, [], [])
        assert pool.replicas.deaths() == 0
    finally:  # not `close`: that leaves the cluster, which this module's tests share
        ray.kill(pool.replicas.ledger)


def test_ledger_charges_a_death_to_what_ran_and_gives_up_after_three():
    """A batch that died runs alone; deaths while alone fall on the request that was running."""
    ledger = Ledger(max_crashes=3)
    batch = ["a", "b", "poison"]
    assert ledger.begin(batch) == (False, {})  # first run: whole, all three running
    # The replica dies. The batch runs again, alone: each request marked as it starts.
    alone, give_up = ledger.begin(batch)
    assert alone and give_up == {}
    ledger.start("a")
    ledger.end(["a"])
    ledger.start("poison")  # dies here, twice
    assert ledger.begin(batch) == (True, {})
    ledger.start("poison")
    alone, give_up = ledger.begin(batch)
    assert alone and give_up == {"poison": 3}  # b and a were charged once, at the first death
    assert ledger.crashes == {"a": 1, "b": 1, "poison": 3} and ledger.deaths() == 5
    assert ledger.begin(["c", "d"]) == (False, {})  # other batches run whole


def test_build_processor_maps_a_dataset_of_prompts(cluster):
    from pagedctl import LLM, SamplingParams

    prompts = [[1, 5 + i, 9, 40 + i] for i in range(12)]
    processor = build_processor(
        {"model": "tiny-llama", "max_num_seqs": 8},
        {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True},
        replicas=2,
        batch_size=4,
    )
    rows = [{"prompt_token_ids": p, "key": i} for i, p in enumerate(prompts)]
    rows.append({"prompt_token_ids": [1, 10**9], "key": 99})
    got = {r["key"]: r for r in processor(ray.data.from_items(rows)).take_all()}
    llm = LLM("tiny-llama", max_num_seqs=8)
    want = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    )
    for i, w in enumerate(want):
        assert list(got[i]["generated_token_ids"]) == w.outputs[0].token_ids
        assert got[i]["error"] is None and got[i]["finish_reason"] == "length"
    assert got[99]["error_code"] == "token_out_of_vocab"
