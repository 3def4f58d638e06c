"""Chat-template fields of a chat line (add_generation_prompt, continue_final_message,
chat_template, chat_template_kwargs), `--chat-template` and `--reasoning-parser`: the prompt is
the one `apply_chat_template` makes with the same arguments, a bad option or template fails its
line alone, and the reasoning split is vLLM's."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedctl import LLM, SamplingParams, bundled_model
from pagedctl.engine.models.source import resolve_model
from pagedctl.engine.models.weights import load_tokenizer
from pagedctl.generate.records import ok_record, split_reasoning
from pagedctl.generate.validate import FieldError, parse_chat_options
from tests.job_utils import FAST, by_id, read_jsonl, run, write_jsonl

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PREFILLED = [*CHAT, {"role": "assistant", "content": "The capital of France is"}]
# Qwen3's way of turning thinking off, on a template of its own: what it prints shows whether
# chat_template_kwargs reached it.
QWEN_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model(str(bundled_model())))


@pytest.fixture(scope="module")
def smol():
    return LLM(bundled_model(), device="cpu", dtype="float32", quantization="none")


def _prompt(llm: LLM, messages: list[dict], chat: dict | None) -> list[int]:
    item = {"messages": messages, **({"chat": chat} if chat is not None else {})}
    (out,) = llm.generate([item], SamplingParams(max_tokens=1, temperature=0.0))
    assert out.ok, out.error
    return out.prompt_token_ids


def _expected(tok, messages: list[dict], **kwargs) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    ("messages", "chat", "kwargs"),
    [
        (CHAT, None, {"add_generation_prompt": True}),
        (CHAT, {"add_generation_prompt": False}, {}),
        (
            PREFILLED,
            {"add_generation_prompt": False, "continue_final_message": True},
            {"continue_final_message": True},
        ),
        (
            CHAT,
            {"chat_template": QWEN_LIKE},
            {"chat_template": QWEN_LIKE, "add_generation_prompt": True},
        ),
        (
            CHAT,
            {"chat_template": QWEN_LIKE, "chat_template_kwargs": {"enable_thinking": False}},
            {"chat_template": QWEN_LIKE, "add_generation_prompt": True, "enable_thinking": False},
        ),
    ],
    ids=["default", "no-generation-prompt", "continue", "template", "template-kwargs"],
)
def test_each_option_renders_as_apply_chat_template_does(smol, tok, messages, chat, kwargs):
    assert _prompt(smol, messages, chat) == _expected(tok, messages, **kwargs)


def test_the_options_change_the_prompt(smol, tok):
    """Each option shows in the text (so the comparison above can fail): the kwargs reach the
    template, a line's template replaces the model's, the final message is left open."""

    def text(messages, chat):
        return tok.decode(_prompt(smol, messages, chat))

    default = text(CHAT, None)
    assert default.endswith("<|im_start|>assistant\n") and "You are a helpful" in default
    assert text(CHAT, {"add_generation_prompt": False}).endswith("France?<|im_end|>\n")
    own = text(CHAT, {"chat_template": QWEN_LIKE})
    assert "You are a helpful" not in own and "<think>" not in own
    off = text(
        CHAT, {"chat_template": QWEN_LIKE, "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    cont = text(PREFILLED, {"add_generation_prompt": False, "continue_final_message": True})
    assert cont.endswith("<|im_start|>assistant\nThe capital of France is")
    closed = text(PREFILLED, {"add_generation_prompt": False})
    assert closed.endswith("The capital of France is<|im_end|>\n")


@pytest.mark.parametrize(
    ("chat", "code", "words"),
    [
        ({"continue_final_message": True}, "invalid_field", "add_generation_prompt false"),
        (
            {"add_generation_prompt": True, "continue_final_message": True},
            "invalid_field",
            "cannot both be true",
        ),
        ({"chat_template_kwargs": {"tokenize": True}}, "invalid_field", "cannot set tokenize"),
        ({"chat_template_kwargs": {"messages": []}}, "invalid_field", "cannot set messages"),
        (
            {"chat_template_kwargs": {"add_generation_prompt": False}},
            "invalid_field",
            "options of their own",
        ),
        ({"chat_template_kwargs": {"chat_template": "x"}}, "invalid_field", "cannot set"),
        ({"chat_templates": "x"}, "invalid_field", "unknown chat options"),
        ({"add_generation_prompt": "no"}, "invalid_field", "true or false"),
        ({"chat_template": "{% if %}"}, "chat_template_failed", "TemplateSyntaxError"),
        (
            {"chat_template": "{{ raise_exception('no system') }}"},
            "chat_template_failed",
            "no system",
        ),
        ({"chat_template": "{{ 1 / 0 }}"}, "chat_template_failed", "ZeroDivisionError"),
    ],
)
def test_bad_options_fail_their_request_alone(smol, chat, code, words):
    params = SamplingParams(max_tokens=2, temperature=0.0)
    bad, good = smol.generate([{"messages": CHAT, "chat": chat}, {"messages": CHAT}], params)
    assert (bad.ok, bad.error_code) == (False, code), bad.error
    assert words in bad.error
    assert good.ok and len(good.outputs[0].token_ids) == 2


def test_a_line_template_serves_a_model_without_one(smol):
    saved = smol.tokenizer.chat_template
    smol.tokenizer.chat_template = None
    try:
        params = SamplingParams(max_tokens=1)
        none, own = smol.generate(
            [{"messages": CHAT}, {"messages": CHAT, "chat": {"chat_template": QWEN_LIKE}}], params
        )
    finally:
        smol.tokenizer.chat_template = saved
    assert none.error_code == "no_chat_template"
    assert own.ok


# -- the line's fields


def test_chat_fields_are_checked_and_belong_to_chat_lines():
    body = {"add_generation_prompt": False, "chat_template_kwargs": {"enable_thinking": False}}
    assert parse_chat_options(body, "chat") == body
    assert parse_chat_options({"chat_template": "", "add_generation_prompt": None}, "chat") is None
    neutral = {"add_generation_prompt": True, "continue_final_message": False}
    assert parse_chat_options({**neutral, "chat_template_kwargs": {}}, "completion") is None
    for key, value in [
        ("chat_template", "{{ 1 }}"),
        ("chat_template_kwargs", {"enable_thinking": False}),
        ("add_generation_prompt", False),
        ("continue_final_message", True),
    ]:
        with pytest.raises(FieldError, match="chat lines") as e:
            parse_chat_options({key: value}, "completion")
        assert e.value.code == "invalid_field"
    for key, value in [
        ("add_generation_prompt", 1),
        ("continue_final_message", "true"),
        ("chat_template", ["x"]),
        ("chat_template_kwargs", [["enable_thinking", False]]),
        ("chat_template", "\ud800"),
    ]:
        with pytest.raises(FieldError, match=key) as e:
            parse_chat_options({key: value}, "chat")
        assert e.value.code == "invalid_field"


# -- the reasoning split


@pytest.mark.parametrize(
    ("text", "qwen3", "deepseek_r1"),
    [
        (
            "<think>\nplan\n</think>\n\nParis.",
            ("\nplan\n", "\n\nParis."),
            ("\nplan\n", "\n\nParis."),
        ),
        ("plan</think>Paris.", (None, "plan</think>Paris."), ("plan", "Paris.")),
        ("Paris.", (None, "Paris."), ("Paris.", None)),
        ("<think>plan, cut", (None, "<think>plan, cut"), ("plan, cut", None)),
        ("<think>plan</think>", ("plan", None), ("plan", None)),
        ("<think></think>Paris.", ("", "Paris."), ("", "Paris.")),
        ("a<think>b</think>c</think>d", ("b", "c</think>d"), ("b", "c</think>d")),
        ("x</think>y<think>z", (None, "z"), ("z", None)),
        ("", (None, ""), ("", None)),
    ],
)
def test_split_reasoning_is_vllms(text, qwen3, deepseek_r1):
    assert split_reasoning(text, "qwen3") == qwen3
    assert split_reasoning(text, "deepseek_r1") == deepseek_r1


def test_split_reasoning_refuses_an_unknown_parser():
    with pytest.raises(ValueError, match="qwen3"):
        split_reasoning("x", "granite")


def test_records_carry_reasoning_content_only_with_a_parser(smol):
    (out,) = smol.generate([{"messages": CHAT}], SamplingParams(max_tokens=3, temperature=0.0))
    text = out.outputs[0].text
    plain = ok_record("a", "chat", "m", out)["response"]["body"]["choices"][0]["message"]
    assert plain == {"role": "assistant", "content": text, "refusal": None}
    split = ok_record("a", "chat", "m", out, reasoning_parser="deepseek_r1", role="user")
    message = split["response"]["body"]["choices"][0]["message"]
    assert message == {"role": "user", "content": None, "reasoning_content": text, "refusal": None}
    completion = ok_record("a", "completion", "m", out, reasoning_parser="qwen3")
    assert completion["response"]["body"]["choices"][0]["text"] == text


# -- a real job


@pytest.mark.slow
def test_a_job_with_chat_fields_a_template_file_and_a_reasoning_parser(tmp_path: Path, tok):
    plain = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
    (tmp_path / "t.jinja").write_text(plain)
    rows = [
        {"custom_id": "file", "messages": CHAT, "max_tokens": 4},
        {"custom_id": "own", "messages": CHAT, "chat_template": QWEN_LIKE, "max_tokens": 4},
        {"custom_id": "user-role", "messages": CHAT, "add_generation_prompt": False,
         "chat_template": QWEN_LIKE, "max_tokens": 2},
        {"custom_id": "broken", "messages": CHAT, "chat_template": "{% for %}"},
        {"custom_id": "both", "messages": PREFILLED, "continue_final_message": True},
        {"custom_id": "clash", "messages": CHAT, "chat_template_kwargs": {"tokenize": True}},
        {"custom_id": "on-prompt", "prompt": "Hello", "chat_template": QWEN_LIKE},
        {"custom_id": "prompt-neutral", "prompt": "Hello", "add_generation_prompt": True,
         "max_tokens": 2},
    ]  # fmt: skip
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    res = run(
        src, *FAST, "--chat-template", tmp_path / "t.jinja", "--reasoning-parser", "deepseek_r1"
    )
    assert res.returncode == 3, res.stderr
    errors = {r["custom_id"]: r["error"] for r in read_jsonl(tmp_path / "in.errors.jsonl")}
    assert {k: e["code"] for k, e in errors.items()} == {
        "broken": "chat_template_failed",
        "both": "invalid_field",
        "clash": "invalid_field",
        "on-prompt": "invalid_field",
    }
    assert "chat lines" in errors["on-prompt"]["message"]
    out = {
        k: r["response"]["body"] for k, r in by_id(read_jsonl(tmp_path / "in.out.jsonl")).items()
    }
    assert set(out) == {"file", "own", "user-role", "prompt-neutral"}
    for cid, template in (("file", plain), ("own", QWEN_LIKE)):
        want = _expected(tok, CHAT, chat_template=template, add_generation_prompt=True)
        assert out[cid]["usage"]["prompt_tokens"] == len(want), cid
    # deepseek_r1: no </think> in the answer, so all of it is reasoning
    message = out["file"]["choices"][0]["message"]
    assert message["content"] is None and message["reasoning_content"]
    assert set(message) == {"role", "content", "reasoning_content", "refusal"}
    assert out["user-role"]["choices"][0]["message"]["role"] == "user"
    assert out["own"]["choices"][0]["message"]["role"] == "assistant"
    assert "message" not in out["prompt-neutral"]["choices"][0]


@pytest.mark.parametrize(
    ("flags", "recipe", "message"),
    [
        (["--chat-template", "missing.jinja"], None, "cannot read the chat template"),
        (["--chat-template", "."], None, "cannot read the chat template"),
        (
            ["--reasoning-parser", "granite"],
            None,
            "--reasoning-parser must be qwen3 or deepseek_r1",
        ),
        ([], "job: {reasoning_parser: r1}\n", "job.reasoning_parser must be qwen3 or deepseek_r1"),
        ([], "job: {chat_template: missing.jinja}\n", "cannot read the chat template"),
    ],
)
def test_bad_chat_flags_are_refused_before_anything_is_loaded_or_written(
    tmp_path: Path, flags, recipe, message, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": "a", "messages": CHAT}])
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


def test_an_empty_or_binary_template_file_is_refused(tmp_path: Path):
    from pagedctl.generate.recipe import read_chat_template

    (tmp_path / "empty.jinja").write_text(" \n")
    (tmp_path / "bin.jinja").write_bytes(b"\xff\xfe{{ x }}")
    (tmp_path / "ok.jinja").write_text("{{ messages }}")
    with pytest.raises(ValueError, match="is empty"):
        read_chat_template(tmp_path / "empty.jinja")
    with pytest.raises(ValueError, match="cannot read"):
        read_chat_template(tmp_path / "bin.jinja")
    assert read_chat_template(tmp_path / "ok.jinja") == "{{ messages }}"
