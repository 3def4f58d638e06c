"""A hostile input, line by line: encodings, numbers, fields, envelopes and prompts that a batch job
meets in the wild. One real job over the whole corpus (the bundled model, a subprocess): every
line gets exactly the record it should, nothing ends the job, a rerun adds nothing. Then whole
files that are not JSONL, refused before anything is loaded or written."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from tests.job_utils import FAST, check_ok_line, read_jsonl, run

OK = "ok"
CHAT = [{"role": "user", "content": "Hi"}]
CHAT_URL, TEXT_URL = "/v1/chat/completions", "/v1/completions"
MODEL = "SmolLM2-135M-Instruct"


def _batch(cid, url, body):
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def _line(value) -> bytes:
    return value if isinstance(value, bytes) else json.dumps(value, ensure_ascii=False).encode()


# (line, the record it must give). The job runs with --max-model-len 64 and max_tokens 4.
CORPUS: list[tuple[bytes | dict, str]] = [
    # -- encodings
    ({"custom_id": "e-ok", "prompt": "caf\u00e9 \U0001f600 \u2028 \u0085 end"}, OK),
    (b'{"custom_id": "e-latin1", "prompt": "caf\xe9"}', "invalid_utf8"),
    (b'{"custom_id": "e-overlong", "prompt": "\xc0\xaf"}', "invalid_utf8"),
    (b'{"custom_id": "e-surrogate", "prompt": "\\ud800"}', "invalid_prompt"),
    (b'{"custom_id": "e-nul", "prompt": "a\x00b"}', "invalid_json"),
    (b'{"custom_id": "e-escaped-nul", "prompt": "a\\u0000b"}', OK),
    (b'{"custom_id": "e-crlf", "prompt": "x"}\r', OK),
    (b"\xef\xbb\xbf", "invalid_json"),  # a BOM is skipped on the first line only
    # -- numbers
    ({"custom_id": "n-tiny-temp", "prompt": "x", "temperature": 1e-50}, OK),
    ({"custom_id": "n-neg-zero-temp", "prompt": "x", "temperature": -0.0}, OK),
    (b'{"custom_id": "n-huge-temp", "prompt": "x", "temperature": 1e400}', "invalid_field"),
    (b'{"custom_id": "n-nan", "prompt": "x", "temperature": NaN}', "invalid_json"),
    ({"custom_id": "n-float-max", "prompt": "x", "max_tokens": 4.0}, OK),  # 4, as OpenAI takes it
    ({"custom_id": "n-fraction-max", "prompt": "x", "max_tokens": 4.5}, "invalid_field"),
    (b'{"custom_id": "n-inf-max", "prompt": "x", "max_tokens": 1e400}', "invalid_field"),
    ({"custom_id": "n-str-max", "prompt": "x", "max_tokens": "4"}, "invalid_field"),
    ({"custom_id": "n-bool-max", "prompt": "x", "max_tokens": True}, "invalid_field"),
    ({"custom_id": "n-big-max", "prompt": "x", "max_tokens": 10**30}, "max_tokens_out_of_range"),
    ({"custom_id": "n-seed-big", "prompt": "x", "seed": 2**64}, "invalid_field"),
    ({"custom_id": "n-seed-neg", "prompt": "x", "seed": -(2**63), "temperature": 1}, OK),
    ({"custom_id": "n-top-p-zero", "prompt": "x", "top_p": 0}, "invalid_field"),
    ({"custom_id": "n-top-k-huge", "prompt": "x", "top_k": 10**12, "temperature": 1}, OK),
    ({"custom_id": "n-huge-token", "prompt_token_ids": [2**40]}, "invalid_prompt"),
    ({"custom_id": "n-oov-token", "prompt_token_ids": [49152]}, "token_out_of_vocab"),
    ({"custom_id": 12345678901234567890, "prompt": "x"}, OK),
    # -- fields
    ({"custom_id": "f-typo", "prompt": "x", "temprature": 0}, "unknown_field"),
    ({"custom_id": "f-max-token", "prompt": "x", "max_token": 5}, "unknown_field"),
    ({"custom_id": "f-hf", "prompt": "x", "max_new_tokens": 5}, "unsupported_field"),
    ({"custom_id": "f-tgi", "prompt": "x", "stop_sequences": ["a"]}, "unsupported_field"),
    ({"custom_id": "f-sample", "prompt": "x", "do_sample": False}, "unsupported_field"),
    ({"custom_id": "f-length-penalty", "prompt": "x", "length_penalty": 2}, "unsupported_field"),
    ({"custom_id": "f-penalty-off", "prompt": "x", "presence_penalty": 0}, OK),
    (b'{"custom_id": "f-dup", "prompt": "x", "max_tokens": 2, "max_tokens": 9}', "duplicate_key"),
    ({"custom_id": "f-salt", "prompt": "x", "cache_salt": "tenant-a"}, OK),
    ({"custom_id": "f-salt-bad", "prompt": "x", "cache_salt": ["a"]}, "invalid_field"),
    ({"custom_id": "f-template", "messages": CHAT, "chat_template_kwargs": {"x": 1}}, OK),
    ({"custom_id": "f-tmpl-prompt", "prompt": "x", "chat_template": "{{ 1 }}"}, "invalid_field"),
    # -- envelopes
    ({**_batch("v-beside", CHAT_URL, {"messages": CHAT}), "max_tokens": 3}, "unknown_field"),
    (_batch("v-model", CHAT_URL, {"model": MODEL, "messages": CHAT}), OK),
    (_batch("v-other-model", CHAT_URL, {"model": "gpt-4o", "messages": CHAT}), "model_not_found"),
    (_batch("v-model-type", CHAT_URL, {"model": ["x"], "messages": CHAT}), "invalid_field"),
    (_batch("v-body-list", CHAT_URL, [CHAT]), "invalid_field"),
    (_batch("v-prompt-in-chat", CHAT_URL, {"prompt": "x"}), "invalid_field"),
    (_batch("v-embeddings", "/v1/embeddings", {"input": "x"}), "unknown_url"),
    ({**_batch("v-get", TEXT_URL, {"prompt": "x"}), "method": "GET"}, "unknown_method"),
    ({"custom_id": "v-ok", "prompt": "x"}, OK),
    ({"custom_id": "v-ok", "prompt": "again"}, "duplicate_custom_id"),
    ({"custom_id": "v-ids", "id": "other", "prompt": "x"}, "invalid_field"),
    ({"custom_id": None, "prompt": "x"}, "missing_custom_id"),
    ("[]", "not_an_object"),
    ("null", "not_an_object"),
    # -- prompts
    ({"custom_id": "p-empty-chat", "messages": []}, "invalid_messages"),
    (
        {
            "custom_id": "p-image",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                }
            ],
        },
        "unsupported_field",
    ),
    ({"custom_id": "p-role", "messages": [{"role": "robot", "content": "x"}]}, "invalid_messages"),
    ({"custom_id": "p-long", "prompt": "word " * 200}, "prompt_too_long"),
    (
        {"custom_id": "p-over", "prompt": "word " * 40, "max_tokens": 40},
        "context_length_exceeded",
    ),
    ({"custom_id": "p-cap", "prompt": "word " * 60, "ignore_eos": True}, OK),
]


def _readable_id(line: bytes | dict | str) -> str | None:
    """The id a record of this corpus line must carry."""
    if isinstance(line, bytes):
        try:
            line = json.loads(line.decode("utf-8", errors="replace"))
        except ValueError:
            return None
    if not isinstance(line, dict) or line.get("id", line.get("custom_id")) != line.get(
        "custom_id", line.get("id")
    ):
        return None
    cid = line.get("custom_id")
    return None if cid is None or "\ufffd" in str(cid) else str(cid)


def _corpus_file(path: Path) -> list[tuple[int, str]]:
    """Write the corpus; return each line's (line number, expected record)."""
    path.write_bytes(b"".join(_line(line) + b"\n" for line, _ in CORPUS))
    return [(no, want) for no, (_, want) in enumerate(CORPUS, 1)]


@pytest.mark.slow
def test_every_hostile_line_gets_its_record_and_the_job_goes_on(tmp_path):
    src = tmp_path / "corpus.jsonl"
    expected = _corpus_file(src)
    args = [src, *FAST, "--max-model-len", "64", "--max-tokens", "4", "--max-num-seqs", "8"]
    res = run(*args)
    assert res.returncode == 3, res.stderr
    assert "Traceback" not in res.stderr
    out = read_jsonl(tmp_path / "corpus.out.jsonl")
    errors = read_jsonl(tmp_path / "corpus.errors.jsonl")
    for r in out:
        check_ok_line(r)
    got = {e["error"]["line"]: e["error"]["code"] for e in errors}
    assert len(got) == len(errors)  # one error record per line
    assert got == {no: code for no, code in expected if code != OK}
    want_ok = {_readable_id(line) for line, want in CORPUS if want == OK}
    assert [r["custom_id"] for r in out if r["custom_id"] in want_ok] == [
        r["custom_id"] for r in out
    ]
    assert {r["custom_id"] for r in out} == want_ok and len(out) == len(want_ok)
    for e in errors:  # OpenAI's output schema: the line's own id, null only if none reads
        assert e["response"] is None and e["error"]["message"]
        assert e["custom_id"] == _readable_id(CORPUS[e["error"]["line"] - 1][0]), e
    # a long prompt with the default max_tokens gets what max_model_len leaves
    cap = next(r for r in out if r["custom_id"] == "p-cap")["response"]["body"]
    assert cap["usage"]["total_tokens"] <= 64

    again = run(*args)  # a rerun resumes a finished job: nothing is added
    assert again.returncode == 3, again.stderr
    assert len(read_jsonl(tmp_path / "corpus.out.jsonl")) == len(out)
    assert len(read_jsonl(tmp_path / "corpus.errors.jsonl")) == len(errors)


def _not_jsonl(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / "in.jsonl"
    line = b'{"custom_id": "a", "prompt": "x"}\n'
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        return Path("/dev/zero")
    elif kind == "utf-16":
        path.write_bytes(line.decode().encode("utf-16"))
    elif kind == "zstd":
        path.write_bytes(b"\x28\xb5\x2f\xfd" + line)
    elif kind == "zip":
        path.write_bytes(b"PK\x03\x04" + line)
    elif kind == "damaged-gzip":
        many = b"".join(b'{"custom_id": "%d", "prompt": "%s"}\n' % (i, b"x" * (i % 97))
                        for i in range(4000))  # fmt: skip
        path.write_bytes(gzip.compress(many)[:5000])
    return path


@pytest.mark.parametrize(
    "kind", ["directory", "fifo", "device", "utf-16", "zstd", "zip", "damaged-gzip"]
)
def test_files_that_are_not_jsonl_are_refused_whole(tmp_path, kind):
    src = _not_jsonl(tmp_path, kind)
    before = sorted(p.name for p in tmp_path.iterdir())
    res = run(src, "-o", tmp_path / "out.jsonl", timeout=120)
    assert res.returncode == 65, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr and res.stderr.startswith("error: "), res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # before the model loads


def test_a_gzip_input_is_a_jsonl_input(tmp_path):
    src = tmp_path / "in.jsonl.gz"
    rows = [{"custom_id": f"r{i}", "prompt": "Hello", "max_tokens": 3} for i in range(3)]
    src.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    res = run(src, *FAST)
    assert res.returncode == 0, res.stderr
    assert {r["custom_id"] for r in read_jsonl(tmp_path / "in.out.jsonl")} == {"r0", "r1", "r2"}
    refused = run(src, *FAST, "-o", tmp_path / "x.jsonl.gz")
    assert refused.returncode == 64 and "uncompressed" in refused.stderr
