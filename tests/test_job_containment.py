"""A request the engine fails on becomes its own `internal_error` record and the job goes on; an
engine that fails on every request stops the job with nothing recorded for them, so a rerun on a
working engine runs them (the job in-process, on a real random-weight model)."""

from __future__ import annotations

import pytest

from pagedctl.exits import EXIT_FAILED, EXIT_PARTIAL
from pagedctl.generate.job import ENGINE_BROKEN_AFTER, GenerateJob, JobExit
from pagedctl.generate.recipe import JobSettings
from tests.job_utils import read_jsonl, write_jsonl

POISON = 77  # a token id no other line holds


def _job(src, poison=None) -> GenerateJob:
    settings = JobSettings(
        input=src,
        engine={"model": "tiny-llama", "device": "cpu", "num_blocks": 64, "max_num_seqs": 4},
        sampling={"max_tokens": 3, "temperature": 0.0},
    )
    job = GenerateJob(settings, force=False, quiet=True, log_format="text")
    if poison is not None:
        llm = job.start_engine()
        real = llm.model.forward

        def forward(input_ids, positions, *args, **kwargs):
            if poison(input_ids):
                raise IndexError("poisoned batch")
            return real(input_ids, positions, *args, **kwargs)

        llm.model.forward = forward
    return job


def _run(job) -> int:
    try:
        return job.run().code
    except JobExit as e:
        return e.code


def _lines(n: int, poisoned: set[int]) -> list[dict]:
    return [
        {
            "custom_id": f"r{i}",
            "prompt_token_ids": [POISON if i in poisoned else 5, 6, 7 + i],
            "logprobs": True,  # the sampled tokens show, as "token_id:<id>" (no tokenizer)
        }
        for i in range(n)
    ]


def test_the_failing_request_gets_its_record_and_the_others_their_results(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", _lines(10, {3}))
    clean = write_jsonl(tmp_path / "clean.jsonl", _lines(10, {3}))
    assert _run(_job(clean)) == 0  # the same lines, no poison: the reference texts
    job = _job(src, poison=lambda ids: bool((ids == POISON).any()))
    assert _run(job) == EXIT_PARTIAL
    (err,) = read_jsonl(tmp_path / "in.errors.jsonl")
    assert (err["custom_id"], err["error"]["code"], err["error"]["line"]) == (
        "r3",
        "internal_error",
        4,
    )
    assert "IndexError: poisoned batch" in err["error"]["message"]
    tokens = _tokens(tmp_path / "in.out.jsonl")
    want = _tokens(tmp_path / "clean.out.jsonl")
    del want["r3"]
    assert tokens == want


def _tokens(path) -> dict[str, list[str]]:
    return {
        r["custom_id"]: r["response"]["body"]["choices"][0]["logprobs"]["tokens"]
        for r in read_jsonl(path)
    }


def test_an_engine_failing_every_request_stops_the_job_and_a_rerun_runs_them(tmp_path):
    n = 3 * ENGINE_BROKEN_AFTER
    src = write_jsonl(tmp_path / "in.jsonl", _lines(n, set()))
    broken = _job(src, poison=lambda ids: True)
    assert _run(broken) == EXIT_FAILED
    assert read_jsonl(tmp_path / "in.errors.jsonl") == []  # no line condemned by a broken device
    assert read_jsonl(tmp_path / "in.out.jsonl") == []
    assert _run(_job(src)) == 0  # the device works again: everything runs
    assert {r["custom_id"] for r in read_jsonl(tmp_path / "in.out.jsonl")} == {
        f"r{i}" for i in range(n)
    }


@pytest.mark.parametrize("poisoned", [{0, 1}, {8, 9}])
def test_a_few_failures_in_a_row_are_recorded_at_the_end_or_on_the_next_success(tmp_path, poisoned):
    src = write_jsonl(tmp_path / "in.jsonl", _lines(10, poisoned))
    job = _job(src, poison=lambda ids: bool((ids == POISON).any()))
    assert _run(job) == EXIT_PARTIAL
    errors = read_jsonl(tmp_path / "in.errors.jsonl")
    assert sorted(e["custom_id"] for e in errors) == sorted(f"r{i}" for i in poisoned)
    assert len(read_jsonl(tmp_path / "in.out.jsonl")) == 8
    assert all("IndexError: poisoned batch" in e["error"]["message"] for e in errors)
