"""`pagedctl generate` end to end: the real CLI in a subprocess on the bundled model."""

import json
import signal

import pytest

from tests.job_utils import (
    FAST,
    by_id,
    check_ok_line,
    completion_text,
    read_jsonl,
    run,
    start,
    wait_for_lines,
    write_jsonl,
)

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_both_formats_chat_and_completions(tmp_path):
    rows = [
        {
            "custom_id": "oa-chat",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "SmolLM2-135M-Instruct", "messages": CHAT, "max_tokens": 12},
        },
        {
            "custom_id": "oa-completion",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "The capital of France is", "max_tokens": 8},
        },
        {"custom_id": "simple-chat", "messages": CHAT, "max_tokens": 24, "stop": ["Paris"]},
        {"id": "simple-prompt", "prompt": "One, two, three,", "max_tokens": 6, "logprobs": True},
        {"custom_id": "ids", "prompt_token_ids": [1, 504, 3458, 282], "max_tokens": 5},
        {
            "custom_id": "n2",
            "messages": CHAT,
            "n": 2,
            "temperature": 1.0,
            "seed": 7,
            "max_tokens": 10,
        },
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    res = run(src, *FAST, "--summary-json", tmp_path / "summary.json")
    assert res.returncode == 0, res.stderr
    out = by_id(read_jsonl(tmp_path / "in.out.jsonl"))
    assert set(out) == {r.get("custom_id", r.get("id")) for r in rows}
    assert read_jsonl(tmp_path / "in.errors.jsonl") == []
    bodies = {cid: check_ok_line(r) for cid, r in out.items()}
    assert bodies["oa-chat"]["object"] == "chat.completion"
    assert bodies["oa-completion"]["object"] == "text_completion"
    assert "Paris" in completion_text(bodies["oa-chat"])
    stopped = bodies["simple-chat"]["choices"][0]
    assert stopped["finish_reason"] == "stop" and "Paris" not in completion_text(
        bodies["simple-chat"]
    )
    lp = bodies["simple-prompt"]["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == bodies["simple-prompt"]["usage"]["completion_tokens"]
    assert len(bodies["n2"]["choices"]) == 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] == 6 and summary["failed"] == 0
    startup = summary["startup"]  # where the time before the first step went
    assert {"import_s", "load_s", "pool_s", "capture_s", "engine_s"} <= startup.keys()
    assert startup["load_s"] > 0 and startup["import_s"] > startup["load_s"] / 100
    assert startup["engine_s"] == pytest.approx(
        sum(
            v
            for k, v in startup.items()
            if k.endswith("_s")
            and k.split("_")[0] in ("load", "profile", "pool", "capture", "calibrate")
        ),
        abs=0.01,
    )
    # The same seed gives the same samples in another run with another batch around it.
    src2 = write_jsonl(tmp_path / "again.jsonl", [rows[5], rows[0]])
    assert run(src2, *FAST).returncode == 0
    again = by_id(read_jsonl(tmp_path / "again.out.jsonl"))["n2"]["response"]["body"]
    assert [completion_text(again, i) for i in (0, 1)] == [
        completion_text(bodies["n2"], i) for i in (0, 1)
    ]


def _requests(n: int) -> list[dict]:
    topics = ["the sea", "a mountain", "coffee", "trains", "the moon", "a library", "rain"]
    return [
        {
            "custom_id": f"r{i:02d}",
            "messages": [
                {
                    "role": "user",
                    "content": f"Write one sentence about {topics[i % len(topics)]} (#{i}).",
                }
            ],
            "max_tokens": 8 + (i * 7) % 33,
        }
        for i in range(n)
    ]


def _results(tmp_path, name: str) -> dict[str, tuple]:
    recs = by_id(
        read_jsonl(tmp_path / f"{name}.out.jsonl") + read_jsonl(tmp_path / f"{name}.errors.jsonl")
    )
    out = {}
    for cid, r in recs.items():  # prefix-cache hits (usage details) depend on timing: left out
        body = r["response"]["body"]
        usage = body["usage"]
        out[cid] = (completion_text(body), usage["prompt_tokens"], usage["completion_tokens"])
    return out


def test_sigkill_and_resume_give_each_result_exactly_once(tmp_path):
    rows = _requests(24)
    ref_src = write_jsonl(tmp_path / "ref.jsonl", rows)
    assert run(ref_src, *FAST, "--max-num-seqs", "4").returncode == 0
    reference = _results(tmp_path, "ref")
    src = write_jsonl(tmp_path / "job.jsonl", rows)
    out = tmp_path / "job.out.jsonl"
    kills = 0
    for target in (3, 9, 15):
        proc = start(src, *FAST, "--max-num-seqs", "4")
        got = wait_for_lines(out, target, proc)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
        assert got >= target
    assert kills >= 2
    final = run(src, *FAST, "--max-num-seqs", "4")
    assert final.returncode == 0, final.stderr
    assert _results(tmp_path, "job") == reference


def test_bad_lines_become_error_records_and_the_job_goes_on(tmp_path):
    good = {"custom_id": "good", "prompt": "Hello", "max_tokens": 4}
    rows = [
        good,
        "{not json",
        "[1, 2]",
        "",
        {"custom_id": "no-prompt", "max_tokens": 4},
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        {
            "custom_id": "bad-method",
            "method": "GET",
            "url": "/v1/completions",
            "body": {"prompt": "x"},
        },
        {"custom_id": "good", "prompt": "again", "max_tokens": 4},
        {"custom_id": "too-long", "prompt": "word " * 300, "max_tokens": 4},
        {"custom_id": "zero-tokens", "prompt": "x", "max_tokens": 0},
        {"custom_id": "n-big", "prompt": "x", "n": 1000},
        {"custom_id": "bad-temp", "prompt": "x", "temperature": "hot"},
        {"custom_id": "huge", "prompt": "y" * 5000},
        {"custom_id": "good-2", "messages": CHAT, "max_tokens": 4},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    with src.open("ab") as f:
        f.write(b'{"custom_id": "latin1", "prompt": "caf\xe9"}\n')
    res = run(src, *FAST, "--max-model-len", "128", "--max-line-bytes", "2048")
    assert res.returncode == 3, res.stderr
    ok = by_id(read_jsonl(tmp_path / "in.out.jsonl"))
    assert set(ok) == {"good", "good-2"}
    errors = read_jsonl(tmp_path / "in.errors.jsonl")
    codes = {(e["error"]["line"], e["error"]["code"]) for e in errors}
    assert codes == {
        (2, "invalid_json"),
        (3, "not_an_object"),
        (5, "missing_prompt"),
        (6, "unknown_url"),
        (7, "unknown_method"),
        (8, "duplicate_custom_id"),
        (9, "prompt_too_long"),
        (10, "max_tokens_out_of_range"),
        (11, "n_out_of_range"),
        (12, "invalid_field"),
        (13, "line_too_long"),
        (15, "invalid_utf8"),
    }
    assert all(e["response"] is None and e["error"]["message"] for e in errors)


def test_unusable_inputs_and_usage_errors(tmp_path):
    assert run(tmp_path).returncode == 65  # a folder
    bad = write_jsonl(tmp_path / "bad.jsonl", ["{", "[]"])
    res = run(bad, *FAST)
    assert res.returncode == 65 and "no valid request" in res.stderr
    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": "a", "prompt": "Hi", "max_tokens": 3}])
    assert run(src, "-o", src).returncode == 64
    assert run(src, *FAST).returncode == 0
    changed = run(src, *FAST, "--max-tokens", "7")
    assert changed.returncode == 64 and "--force" in changed.stderr
    assert run(src, *FAST, "--max-tokens", "7", "--force").returncode == 0  # nothing left to do


def test_lock_and_signals(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", _requests(40))
    out = tmp_path / "in.out.jsonl"
    first = start(src, *FAST, "--max-num-seqs", "2")
    wait_for_lines(out, 1, first)
    second = run(src, *FAST)
    assert second.returncode == 75 and "in.out.jsonl.lock" in second.stderr
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=60) == 75
    kept = len(read_jsonl(out))
    assert 1 <= kept < 40
    third = start(src, *FAST, "--max-num-seqs", "2")
    wait_for_lines(out, kept + 1, third)
    third.send_signal(signal.SIGINT)
    assert third.wait(timeout=60) == 130
    final = run(src, *FAST)
    assert final.returncode == 0, final.stderr
    assert len(by_id(read_jsonl(out))) == 40


def test_quiet_and_json_logs(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": "a", "prompt": "Hi", "max_tokens": 3}])
    quiet = run(src, *FAST, "--quiet")
    assert quiet.returncode == 0 and quiet.stdout == "" and quiet.stderr == ""
    src2 = write_jsonl(tmp_path / "b.jsonl", [{"custom_id": "b", "prompt": "Hi", "max_tokens": 3}])
    logged = run(src2, *FAST, "--log-format", "json")
    assert logged.returncode == 0
    events = [json.loads(line) for line in logged.stderr.splitlines() if line.startswith("{")]
    assert events[0]["event"] == "start" and events[-1]["event"] == "summary"
    assert events[-1]["ok"] == 1 and events[-1]["output_tokens"] == 3


@pytest.mark.parametrize(
    ("flags", "recipe", "message"),
    [
        (["--temperature", "-1"], None, "temperature must be >= 0"),
        (["--top-p", "5"], None, "top_p must be in (0, 1]"),
        (["--max-tokens", "0"], None, "max_tokens must be >= 1"),
        ([], "sampling: {temperature: hot}\n", "temperature must be a number, got 'hot'"),
        ([], "engine: {block_size: sixteen}\n", "block_size must be an integer >= 1"),
        (["--max-num-seqs", "0"], None, "max_num_seqs must be an integer >= 1, got 0"),
        (["--max-model-len", "0"], None, "max_model_len must be an integer >= 1, got 0"),
        (["--gpu-memory-utilization", "1.5"], None, "must be a number in (0, 1]"),
    ],
)
def test_bad_settings_are_refused_before_anything_is_loaded_or_written(
    tmp_path, flags, recipe, message
):
    """Exit 64 with one line, and no output, errors file, manifest or lock left behind: the
    corrected rerun is a first run, not "different settings"."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": "a", "prompt": "Hi", "max_tokens": 3}])
    args = [src, "--model", "no-such-model-is-ever-loaded", *flags]
    if recipe is not None:
        (tmp_path / "r.yaml").write_text(recipe)
        args += ["--recipe", tmp_path / "r.yaml"]
    res = run(*args)
    assert res.returncode == 64, res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["in.jsonl"] + (["r.yaml"] if recipe else [])
    )


def test_the_errors_file_follows_a_given_output(tmp_path):
    src = write_jsonl(
        tmp_path / "in.jsonl", ["{", {"custom_id": "a", "prompt": "Hi", "max_tokens": 2}]
    )
    (tmp_path / "elsewhere").mkdir()
    res = run(src, *FAST, "-o", tmp_path / "elsewhere" / "x.out.jsonl")
    assert res.returncode == 3, res.stderr
    assert len(read_jsonl(tmp_path / "elsewhere" / "x.errors.jsonl")) == 1
    assert not (tmp_path / "in.errors.jsonl").exists()


def test_log_lines_are_verbatim_and_json_mode_ends_in_an_error_event(tmp_path):
    folder = tmp_path / "a[" / "b]c [bold]x"  # the path holds Rich's "[/b]" and "[bold]"
    folder.mkdir(parents=True)
    src = write_jsonl(folder / "in.jsonl", [{"custom_id": "a", "prompt": "Hi", "max_tokens": 2}])
    res = run(src, *FAST)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert str(folder) in res.stderr  # printed as it is, markup and all, on one line
    missing = run(tmp_path / "nowhere.jsonl", "--log-format", "json")
    lines = [json.loads(line) for line in missing.stderr.splitlines()]
    assert missing.returncode == 65 and lines[-1]["event"] == "error"
    assert lines[-1]["exit_code"] == 65 and "nowhere.jsonl" in lines[-1]["message"]


def test_an_output_linked_to_the_input_is_refused_and_nothing_changes(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": "a", "prompt": "Hi", "max_tokens": 2}])
    before = src.read_bytes()
    (tmp_path / "hard.jsonl").hardlink_to(src)
    (tmp_path / "soft.jsonl").symlink_to(src)
    for link in ("hard.jsonl", "soft.jsonl"):
        res = run(src, "-o", tmp_path / link)
        assert res.returncode == 64 and "must all differ" in res.stderr, res.stderr
        res = run(src, "--errors", tmp_path / link)
        assert res.returncode == 64 and "must all differ" in res.stderr, res.stderr
    assert src.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hard.jsonl", "in.jsonl", "soft.jsonl"]
