"""Beam search in `pagedctl generate`: the line fields and their refusals, the records and the
summary (the job in-process on the dummy `tiny-llama` preset, checked against `LLM.beam_search`
on an engine of its own)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pagedctl.engine import LLM, BeamSearchParams, SamplingParams
from pagedctl.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedctl.generate.job import GenerateJob, exit_code_for
from pagedctl.generate.reader import JobRequest, LineError, ReaderLimits, read_requests
from pagedctl.generate.recipe import JobSettings
from pagedctl.generate.records import dumps, ok_record
from pagedctl.generate.report import print_summary
from pagedctl.generate.summary import beam_summary
from pagedctl.generate.validate import FieldError, engine_params
from pagedctl.models.bundled import engine_settings
from tests.job_utils import by_id, check_ok_line, read_jsonl, write_jsonl

CHAT_URL, TEXT_URL = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
LIMITS = ReaderLimits(max_tokens_limit=512, max_n=8, default_max_tokens=6)
# block_size 4: a 10-token prompt fills two blocks that every beam shares
ENGINE = {"model": "tiny-llama", "device": "cpu", "num_blocks": 128, "block_size": 4,
          "max_num_seqs": 16}  # fmt: skip
DEFAULTS = {"max_tokens": 6, "temperature": 0.0}  # the job's sampling defaults


def _batch(cid: str, url: str, body: dict) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def _read(tmp_path: Path, rows: list, limits: ReaderLimits = LIMITS) -> list:
    return list(read_requests(write_jsonl(tmp_path / "in.jsonl", rows), limits))


def _one(tmp_path: Path, row: dict) -> JobRequest | LineError:
    (item,) = _read(tmp_path, [row])
    return item


# ---------------------------------------------------------------- the line fields


def test_a_beam_line_becomes_beam_search_params(tmp_path: Path) -> None:
    body = {"messages": MSG, "use_beam_search": True, "n": 3, "max_tokens": 9,
            "length_penalty": 0, "early_stopping": "never", "logprobs": True,
            "stop_token_ids": [7], "ignore_eos": False, "cache_salt": "t", "best_of": 3,
            "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 4,
            "stop": []}  # fmt: skip
    req = _one(tmp_path, _batch("a", CHAT_URL, body))
    assert isinstance(req, JobRequest), req
    assert req.sampling["use_beam_search"] is True
    params = engine_params(req.sampling, DEFAULTS)
    assert params == BeamSearchParams(
        beam_width=3, max_tokens=9, length_penalty=0.0, early_stopping="never", logprobs=True,
        stop_token_ids=(7,), cache_salt="t", strict_max_tokens=True,
    )  # fmt: skip


def test_beam_search_takes_the_job_defaults_it_can_use(tmp_path: Path) -> None:
    req = _one(tmp_path, {"id": "a", "prompt": "p", "use_beam_search": True, "n": 2})
    params = engine_params(req.sampling, {"temperature": 1.0, "ignore_eos": True, "seed": 3})
    assert params == BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
    # the completions form's integer logprobs means true, as for sampling
    req = _one(tmp_path, _batch("b", TEXT_URL, {"prompt": [1, 2], "use_beam_search": True,
                                                "n": 1, "logprobs": 0}))  # fmt: skip
    assert engine_params(req.sampling, {}) == BeamSearchParams(1, max_tokens=6, logprobs=True)


def test_beam_fields_at_their_neutral_values_leave_sampling_alone(tmp_path: Path) -> None:
    rows = [
        {"id": "a", "prompt": "p", "length_penalty": 1.0, "early_stopping": False, "n": 2},
        {"id": "b", "prompt": "p", "use_beam_search": False, "temperature": 0.5},
        {"id": "c", "prompt": "p", "use_beam_search": None},
    ]
    a, b, c = _read(tmp_path, rows)
    assert a.sampling == {"max_tokens": 6, "n": 2}
    assert b.sampling == {"max_tokens": 6, "temperature": 0.5}
    assert c.sampling == {"max_tokens": 6}
    assert all(isinstance(engine_params(r.sampling, DEFAULTS), SamplingParams) for r in (a, b, c))


BEAM = {"use_beam_search": True, "n": 2}
# (code, line, words the message must hold)
# fmt: off
BAD_LINES: list[tuple[str, dict, tuple[str, ...]]] = [
    ("unsupported_field", {"id": "x", "prompt": "p", **BEAM, "stop": ["\n"]}, ("stop_token_ids",)),
    ("unsupported_field", {"id": "x", "prompt": "p", **BEAM, "stop": "."}, ("stop_token_ids",)),
    ("unsupported_field", {"id": "x", "prompt": "p", "length_penalty": 2},
     ("use_beam_search", "remove length_penalty")),
    ("unsupported_field", _batch("x", CHAT_URL, {"messages": MSG, "early_stopping": True}),
     ("use_beam_search", "remove early_stopping")),
    ("invalid_field", {"id": "x", "prompt": "p", **BEAM, "early_stopping": "sometimes"},
     ("early_stopping", '"never"')),
    ("invalid_field", {"id": "x", "prompt": "p", "early_stopping": "sometimes"}, ("never",)),
    ("invalid_field", {"id": "x", "prompt": "p", **BEAM, "length_penalty": "long"},
     ("length_penalty", "a number")),
    ("n_out_of_range", {"id": "x", "prompt": "p", "use_beam_search": True, "n": 0}, ("1..8",)),
    ("n_out_of_range", {"id": "x", "prompt": "p", "use_beam_search": True, "n": 9}, ("1..8",)),
    ("invalid_field", {"id": "x", "prompt": "p", "use_beam_search": True}, ("needs n", "1..8")),
    ("invalid_field", {"id": "x", "prompt": "p", "use_beam_search": "yes", "n": 2},
     ("use_beam_search", "true or false")),
    ("invalid_field", {"id": "x", "prompt": "p", "use_beam_search": 1, "n": 2}, ("true or false",)),
    ("unsupported_field", {"id": "x", "prompt": "p", **BEAM, "best_of": 4}, ("best_of", "(2)")),
    ("unsupported_field", {"id": "x", "prompt": "p", **BEAM, "best_of": 1}, ("best_of", "(2)")),
    ("invalid_field", {"id": "x", "prompt": "p", **BEAM, "temperature": -1}, ("temperature",)),
    ("unsupported_field", {"id": "x", "prompt": "p", "num_beams": 4},
     ("n with use_beam_search",)),
    ("unsupported_field", _batch("x", TEXT_URL, {"prompt": "p", **BEAM, "logprobs": 3}),
     ("logprobs",)),
]
# fmt: on


@pytest.mark.parametrize(("code", "row", "words"), BAD_LINES)
def test_bad_beam_lines_are_refused_with_what_to_fix(
    tmp_path: Path, code: str, row: dict, words: tuple[str, ...]
) -> None:
    err = _one(tmp_path, row)
    assert isinstance(err, LineError), err
    assert (err.code, err.custom_id) == (code, "x"), err.message
    assert all(w in err.message for w in words), err.message
    assert len(err.message) < 200


def test_default_stop_strings_refuse_a_beam_line_unless_it_clears_them() -> None:
    beam = {"max_tokens": 4, "use_beam_search": True, "n": 2}
    with pytest.raises(FieldError, match='"stop": \\[\\]') as e:
        engine_params(beam, {"stop": ["\n"]})
    assert e.value.code == "unsupported_field" and "default" in e.value.message
    assert engine_params({**beam, "stop": []}, {"stop": ["\n"]}) == BeamSearchParams(2, 4)
    assert engine_params({"max_tokens": 4}, {"stop": ["\n"]}).stop == ("\n",)


# ---------------------------------------------------------------- the records


def test_beam_records_carry_each_hypothesis_best_first() -> None:
    hyps = [
        CompletionOutput(0, "ab", [1, 2], "stop", 2, [-0.5, -0.25], -0.75),
        CompletionOutput(1, "abc", [1, 2, 3], "length", None, [-0.5, -0.5, -math.inf], -math.inf),
    ]
    out = RequestOutput("r", 0, "p", [9, 9, 9], outputs=hyps, metrics=RequestMetrics())
    chat = json.loads(dumps(ok_record("r", "chat", "m", out)))["response"]["body"]
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in chat["choices"]] == ["ab", "abc"]
    assert [c["cumulative_logprob"] for c in chat["choices"]] == [-0.75, -9999.0]
    second = chat["choices"][1]["logprobs"]["content"]
    assert [t["logprob"] for t in second] == [-0.5, -0.5, -9999.0]
    assert chat["usage"]["completion_tokens"] == 5  # every returned hypothesis's tokens
    text = json.loads(dumps(ok_record("r", "completion", "m", out)))["response"]["body"]
    assert [c["cumulative_logprob"] for c in text["choices"]] == [-0.75, -9999.0]
    assert text["choices"][0]["logprobs"]["token_logprobs"] == [-0.5, -0.25]
    sampled = RequestOutput("r", 0, "p", [9], outputs=[CompletionOutput(0, "a", [1], "stop", 2)])
    (choice,) = ok_record("r", "chat", "m", sampled)["response"]["body"]["choices"]
    assert "cumulative_logprob" not in choice  # a sample has no such key


# ---------------------------------------------------------------- the job


def _job(src: Path, sampling: dict | None = None, **engine) -> GenerateJob:
    settings = JobSettings(
        input=src, engine={**ENGINE, **engine}, sampling=sampling or dict(DEFAULTS)
    )
    return GenerateJob(settings, force=False, quiet=True, log_format="text")


PROMPT_A = [5, 17, 99, 3, 42, 8, 1, 200, 31, 7]
PROMPT_B = [11, 12, 13, 14, 15, 16, 17, 18, 19]
GOOD = {
    "simple": ({"custom_id": "simple", "prompt_token_ids": PROMPT_A, "use_beam_search": True,
                "n": 4, "max_tokens": 8, "ignore_eos": True},
               BeamSearchParams(4, max_tokens=8, ignore_eos=True, strict_max_tokens=True)),
    "openai": (_batch("openai", TEXT_URL, {"prompt": PROMPT_B, "use_beam_search": True, "n": 3,
                                           "length_penalty": 0.5, "early_stopping": True,
                                           "temperature": 0.8, "logprobs": 1,
                                           "stop_token_ids": [44]}),
               BeamSearchParams(3, max_tokens=6, length_penalty=0.5, early_stopping=True,
                                logprobs=True, stop_token_ids=(44,))),
    "width1": ({"id": "width1", "prompt_token_ids": PROMPT_A[:5], "use_beam_search": True,
                "n": 1, "length_penalty": 0.0, "early_stopping": "never"},
               BeamSearchParams(1, max_tokens=6, length_penalty=0.0, early_stopping="never")),
}  # fmt: skip
SAMPLED = [
    {"custom_id": "greedy", "prompt_token_ids": PROMPT_A, "max_tokens": 5},
    {"custom_id": "n2", "prompt_token_ids": PROMPT_B, "n": 2, "temperature": 1.0, "seed": 3},
]
BAD = {  # custom_id -> (line, code)
    "stop-str": ({"id": "stop-str", "prompt_token_ids": PROMPT_A, **BEAM, "stop": ["x"]},
                 "unsupported_field"),
    "lp-alone": ({"id": "lp-alone", "prompt_token_ids": PROMPT_A, "length_penalty": 2},
                 "unsupported_field"),
    "es-bad": (_batch("es-bad", TEXT_URL, {"prompt": PROMPT_A, **BEAM,
                                           "early_stopping": "sometimes"}), "invalid_field"),
    "n0": ({"id": "n0", "prompt_token_ids": PROMPT_A, "use_beam_search": True, "n": 0},
           "n_out_of_range"),
    "yes": ({"id": "yes", "prompt_token_ids": PROMPT_A, "use_beam_search": "yes", "n": 2},
            "invalid_field"),
}  # fmt: skip


def _choices(body: dict) -> list[tuple]:
    return [(c["logprobs"]["tokens"] if c["logprobs"] else None, c["finish_reason"],
             c["stop_reason"], c["cumulative_logprob"]) for c in body["choices"]]  # fmt: skip


def _expected(outs: list[RequestOutput], logprobs: bool) -> list[list[tuple]]:
    return [
        [([f"token_id:{t}" for t in c.token_ids] if logprobs else None, c.finish_reason,
          c.stop_reason, c.cumulative_logprob) for c in o.outputs]
        for o in outs
    ]  # fmt: skip


def test_a_job_runs_beam_lines_beside_sampled_and_bad_ones(tmp_path: Path, capsys) -> None:
    rows = [GOOD["simple"][0], BAD["stop-str"][0], SAMPLED[0], GOOD["openai"][0],
            BAD["lp-alone"][0], BAD["es-bad"][0], SAMPLED[1], BAD["n0"][0], GOOD["width1"][0],
            BAD["yes"][0]]  # fmt: skip
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    summary = _job(src).run().summary
    assert exit_code_for(summary) == 3
    assert (summary["ok"], summary["failed"]) == (len(GOOD) + len(SAMPLED), len(BAD))

    errors = by_id(read_jsonl(tmp_path / "in.errors.jsonl"))
    assert {cid: r["error"]["code"] for cid, r in errors.items()} == {
        cid: code for cid, (_, code) in BAD.items()
    }
    assert errors["stop-str"]["error"]["line"] == 2
    assert "stop_token_ids" in errors["stop-str"]["error"]["message"]
    assert "use_beam_search" in errors["lp-alone"]["error"]["message"]

    bodies = {
        cid: check_ok_line(r) for cid, r in by_id(read_jsonl(tmp_path / "in.out.jsonl")).items()
    }
    # the same prompts and params straight through the engine, on an engine of its own
    llm = LLM(**engine_settings(ENGINE))
    prompts = [PROMPT_A, PROMPT_B, PROMPT_A[:5]]
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           [params for _, params in GOOD.values()])  # fmt: skip
    for (cid, (_, params)), want in zip(GOOD.items(), outs, strict=True):
        body = bodies[cid]
        assert want.ok and len(body["choices"]) == params.beam_width
        assert [c["index"] for c in body["choices"]] == list(range(params.beam_width))
        got = _choices(body)
        expected = _expected([want], params.logprobs)[0]
        assert [g[:3] for g in got] == [e[:3] for e in expected], cid
        assert [g[3] for g in got] == pytest.approx([e[3] for e in expected], abs=1e-4), cid
        usage = body["usage"]
        assert usage["prompt_tokens"] == len(want.prompt_token_ids)
        assert usage["completion_tokens"] == sum(len(c.token_ids) for c in want.outputs)
        if params.logprobs:  # each token's own, summing to the hypothesis's
            for c in body["choices"]:
                lps = c["logprobs"]["token_logprobs"]
                assert math.fsum(lps) == pytest.approx(c["cumulative_logprob"], abs=1e-3)
    scores = [c["cumulative_logprob"] for c in bodies["simple"]["choices"]]
    assert scores == sorted(scores, reverse=True)  # length_penalty 1, ignore_eos: best first
    for cid in ("greedy", "n2"):
        assert all("cumulative_logprob" not in c for c in bodies[cid]["choices"])
    assert len(bodies["n2"]["choices"]) == 2

    beams = llm.stats["beam_search"]
    assert summary["beam_search"] == beam_summary(beams)["beam_search"]
    figures = summary["beam_search"]
    assert figures["requests"] == len(GOOD)
    assert 0 < figures["peak_blocks"] < figures["peak_blocks_unshared"]  # the prompts are shared
    assert figures["shared_saving"] == round(
        1 - figures["peak_blocks"] / figures["peak_blocks_unshared"], 4
    )
    assert figures["cow_copies"] == beams["num_cow_copies"] > 0

    print_summary(summary, quiet=False, log_format="text")
    table = capsys.readouterr().out
    assert "beam searches" in table and f"{figures['shared_saving']:.1%}" in table


def test_a_job_without_beams_has_no_beam_figures(tmp_path: Path, capsys) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [SAMPLED[0]])
    summary = _job(src).run().summary
    assert summary["ok"] == 1 and "beam_search" not in summary
    assert beam_summary({"num_groups": 0, "peak_blocks": 0, "peak_blocks_unshared": 0,
                         "num_shared_blocks": 0, "num_cow_copies": 0}) == {}  # fmt: skip
    print_summary(summary, quiet=False, log_format="text")
    assert "beam searches" not in capsys.readouterr().out


def test_default_stop_strings_and_engine_refusals_become_records(tmp_path: Path) -> None:
    rows = [
        {"id": "beam", "prompt_token_ids": PROMPT_A, **BEAM},  # under the job's --stop
        {"id": "cleared", "prompt_token_ids": PROMPT_A, **BEAM, "stop": []},
        {"id": "wide", "prompt_token_ids": PROMPT_A, "use_beam_search": True, "n": 5, "stop": []},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    job = _job(src, {**DEFAULTS, "stop": ["\n"]}, max_num_batched_tokens=4)
    summary = job.run().summary
    assert (summary["ok"], summary["failed"]) == (1, 2)
    errors = by_id(read_jsonl(tmp_path / "in.errors.jsonl"))
    assert errors["beam"]["error"]["code"] == "unsupported_field"
    assert errors["beam"]["error"]["line"] == 1
    assert '"stop": []' in errors["beam"]["error"]["message"]
    assert errors["wide"]["error"]["code"] == "beam_width_too_large"
    assert set(by_id(read_jsonl(tmp_path / "in.out.jsonl"))) == {"cleared"}
    # a rerun resumes: every line has its record, none is run or written again
    again = _job(src, {**DEFAULTS, "stop": ["\n"]}, max_num_batched_tokens=4).run().summary
    assert (again["skipped_resumed"], again["ok"], again["failed"]) == (3, 0, 0)
    assert len(read_jsonl(tmp_path / "in.errors.jsonl")) == 2
