"""A fuzzed input corpus through the whole `generate` job (in process, dummy tiny model)."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedctl.exits import EXIT_DATAERR
from pagedctl.generate.job import GenerateJob, JobExit
from pagedctl.generate.recipe import JobSettings
from tests.job_utils import read_jsonl

ids = st.lists(st.integers(0, 600), min_size=0, max_size=40)  # 512+ is outside the vocabulary
valid = st.fixed_dictionaries(
    {"custom_id": st.sampled_from([f"c{i}" for i in range(12)]), "prompt_token_ids": ids},
    optional={
        "max_tokens": st.integers(-2, 40),
        "temperature": st.one_of(st.floats(-1, 3, allow_nan=False), st.text(max_size=3)),
        "n": st.integers(0, 20),
        "top_k": st.integers(-3, 50),
        "seed": st.integers(-5, 2**70),
        "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=3), max_size=3)),
        "prompt": st.text(max_size=8),
    },
)
openai = st.fixed_dictionaries(
    {
        "custom_id": st.text(max_size=6),
        "method": st.sampled_from(["POST", "GET"]),
        "url": st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/embeddings"]),
        "body": st.fixed_dictionaries(
            {"prompt": st.one_of(ids, st.text(max_size=5))},
            optional={"max_tokens": st.integers(0, 30)},
        ),
    }
)
line = st.one_of(
    valid.map(json.dumps),
    openai.map(json.dumps),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
    ).map(json.dumps),
    st.binary(max_size=30).map(lambda b: b.decode("latin-1")),
    st.just(""),
)


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(lines=st.lists(line, min_size=1, max_size=40))
def test_every_line_gets_exactly_one_record(tmp_path_factory, lines):
    folder = tmp_path_factory.mktemp("fuzz")
    src = folder / "in.jsonl"
    src.write_bytes(
        "\n".join(ln.replace("\n", " ") for ln in lines).encode("utf-8", "replace") + b"\n"
    )
    nonempty = sum(1 for raw in src.read_bytes().split(b"\n") if raw.strip())
    job = GenerateJob(
        JobSettings(
            input=src,
            engine={"model": "tiny-llama", "device": "cpu", "num_blocks": 64, "max_num_seqs": 8},
            sampling={"max_tokens": 4},
        ),
        force=False,
        quiet=True,
        log_format="text",
    )
    try:
        code = job.run().code
    except JobExit as e:
        code = e.code
    assert code in (0, 3, EXIT_DATAERR)
    ok = read_jsonl(folder / "in.out.jsonl")
    errors = read_jsonl(folder / "in.errors.jsonl")
    assert len(ok) + len(errors) == nonempty
    assert len({r["custom_id"] for r in ok}) == len(ok)
    assert all(e["error"]["code"] and e["error"]["message"] for e in errors)
    assert code == (
        EXIT_DATAERR
        if not ok
        and not any(
            e["error"]["code"]
            in ("prompt_too_long", "token_out_of_vocab", "no_tokenizer", "empty_prompt")
            for e in errors
        )
        else 3
        if errors
        else 0
    )
