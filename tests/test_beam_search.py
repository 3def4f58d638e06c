"""Beam search against transformers' own `generate(num_beams=...)`: the same hypotheses token for
token, in the same order, with the same scores, on the tiny random models and on the bundled
SmolLM2; and the pool's accounting of the blocks that beams share.

transformers' `sequences_scores` are `cumulative_logprob / len(token_ids) ** length_penalty` of
ours, `len` counting the EOS token that ended a hypothesis. A "no EOS" run is `ignore_eos=True`
here and no `eos_token_id` there.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import random
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.utils import GenerationMixin

from pagedctl import bundled_model
from pagedctl.engine import LLM, BeamSearchParams
from tests.tiny_models import save_tiny_model

# A tiny random model's next-token distribution is almost flat: its logits have a standard
# deviation of about 0.2, every log-probability is near -log(256) = -5.5, and a cumulative score
# after 12 tokens is near -66, where float32 steps are 8e-6 apart. Candidates of different beams
# then tie or nearly tie (exactly, at times), and which of them survives is decided by rounding,
# not by the model. Scaling the final norm's weight multiplies every logit by the same constant
# (a softmax temperature of about 0.1, nothing else changes), here to a standard deviation of 2:
# competing candidates of the cases below are then 2e-2 apart at the median and never less than
# 7e-5, against at most 6e-6 between the engine's 12-token scores and transformers' (3e-6 per
# token). `margin` checks every case for it.
LOGIT_STD = 2.0
# Each case's smallest gap, in transformers' own run, between adjacent candidates of a step (or
# adjacent final scores): below this, the case would test rounding, not the engine.
MIN_MARGIN = 5e-5
ATOL = 1e-4
# The EOS id of each tiny model (its config's eos_token_id, which the engine uses): a token that
# its beams reach within MAX_TOKENS on the prompts of the cases below, so that hypotheses both
# stop at EOS and run to the length limit.
EOS = {"llama": 94, "qwen2": 14, "qwen3": 228, "mistral": 94}  # mistral: its no-EOS cases
MAX_TOKENS = 12

_rng = random.Random(0)
PROMPTS = [[_rng.randrange(256) for _ in range(n)] for n in (7, 23, 45)]
LONG_PROMPTS = [[_rng.randrange(256) for _ in range(n)] for n in (40, 50, 60)]
# Llama's beams of every width, greedy included, reach EOS on these (qwen2's and qwen3's greedy
# paths, with tied embeddings, repeat one token and rarely do).
WIDTH_PROMPTS = [
    [166, 173, 158],
    [85, 123, 81, 52, 222, 193, 150, 129, 244, 161, 51, 106, 162, 20, 13, 5, 151, 163, 230, 200]
    + [160, 204, 32, 32, 162, 233, 57, 128, 110, 240, 182],
    [141, 155, 106, 106, 121, 170, 137, 35, 38, 188, 239, 25, 86, 152, 138, 182, 118, 200, 204]
    + [88, 247, 132, 168, 113, 132, 125, 15, 206, 162, 221, 127, 137, 97, 37, 84, 227, 75, 134]
    + [235, 83, 70, 70, 225],
]
# A prompt and a stop token (not the EOS) with which Llama's early-stopping rules differ.
ES_PROMPT = [165, 77, 202, 24, 37, 48, 187, 29, 109, 19, 44, 222]
ES_STOP = 103


def save_beam_model(arch: str, folder: Path):
    """The tiny model of `arch` with its logits scaled to LOGIT_STD, saved with EOS[arch] as the
    config's eos_token_id; returns the transformers model (its own config has no EOS)."""
    model = save_tiny_model(arch, folder)
    with torch.no_grad():
        std = model(torch.tensor([PROMPTS[0]])).logits.std().item()
        model.model.norm.weight.mul_(LOGIT_STD / std)
    model.save_pretrained(folder, safe_serialization=True)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["eos_token_id"] = EOS[arch]
    config_file.write_text(json.dumps(config))
    return model


# ---------------------------------------------------------------- transformers' side


@dataclass
class Reference:
    """transformers' hypotheses for one prompt, best first."""

    token_ids: list[list[int]]
    scores: list[float]  # sequences_scores
    logprobs: list[list[float]]  # each token's log-probability (transition scores)
    margin: float = float("inf")  # smallest gap between competing candidates or final scores
    gaps: list[float] = field(default_factory=list)


@contextlib.contextmanager
def recorded_gaps(gaps: list[float]):
    """Record, at every step of transformers' beam search, the smallest gap between adjacent
    candidates among the best `beams_to_keep + 1` (a private method; nothing is recorded when
    it is gone)."""
    real = getattr(GenerationMixin, "_get_top_k_continuations", None)
    if real is None:
        yield
        return

    def wrapper(self, accumulated_log_probs, *args, beams_to_keep, **kwargs):
        top = torch.topk(accumulated_log_probs, k=beams_to_keep + 1).values
        for row in top:
            row = row[row > -1e8]  # the first step's placeholder beams
            if row.numel() > 1:
                gaps.append((row[:-1] - row[1:]).min().item())
        return real(self, accumulated_log_probs, *args, beams_to_keep=beams_to_keep, **kwargs)

    with mock.patch.object(GenerationMixin, "_get_top_k_continuations", wrapper):
        yield


def f32_sum(values) -> float:
    """A float32 running sum, as transformers accumulates beam scores."""
    total = np.float32(0.0)
    for v in values:
        total = np.float32(total + np.float32(v))
    return float(total)


def stop_ids(p: BeamSearchParams, eos: list[int]) -> list[int]:
    """The tokens that end a beam: the model's EOS ids (unless `ignore_eos`) and `p`'s stop
    tokens, which transformers takes together as its `eos_token_id` list."""
    ids = [] if p.ignore_eos else list(eos)
    return ids + [t for t in p.stop_token_ids if t not in ids]


@torch.no_grad()
def hf_beam_search(model, prompt: list[int], p: BeamSearchParams, eos: list[int]) -> Reference:
    """transformers' `generate` with `p`'s settings, `eos` being the model's EOS ids.

    With one beam, transformers runs greedy search, which is what beam search of width 1 is
    (its early-stopping rules end the search at the first stop token that wins the step)."""
    k = p.beam_width
    stops = stop_ids(p, eos)
    ids = torch.tensor([prompt])
    model.generation_config = GenerationConfig()  # nothing from a saved generation config
    gaps: list[float] = []
    with recorded_gaps(gaps):
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            num_beams=k,
            num_return_sequences=k,
            do_sample=False,
            max_new_tokens=p.max_tokens,
            length_penalty=p.length_penalty,
            early_stopping=p.early_stopping,
            output_scores=True,
            output_logits=k == 1,
            return_dict_in_generate=True,
            eos_token_id=stops or None,
            pad_token_id=stops[0] if stops else 0,
        )
    n = len(prompt)
    if k == 1:
        tokens = out.sequences[0, n:].tolist()
        steps = [torch.log_softmax(s[0].float(), -1) for s in out.logits]
        lps = [step[t].item() for step, t in zip(steps, tokens, strict=True)]
        for step in steps:
            top2 = step.topk(2).values
            gaps.append((top2[0] - top2[1]).item())
        cum = f32_sum(lps)
        score = float(np.float32(cum) / np.float32(len(tokens) ** p.length_penalty))
        return Reference([tokens], [score], [lps], min(gaps), gaps)
    transitions = model.compute_transition_scores(out.sequences, out.scores, out.beam_indices)
    token_ids, logprobs = [], []
    for i in range(k):
        length = int((out.beam_indices[i] != -1).sum())
        token_ids.append(out.sequences[i, n : n + length].tolist())
        logprobs.append(transitions[i, :length].tolist())
    scores = out.sequences_scores.tolist()
    gaps += [a - b for a, b in itertools.pairwise(scores)]
    return Reference(token_ids, scores, logprobs, min(gaps), gaps)


# ---------------------------------------------------------------- the engine's side


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """arch -> (folder, transformers model), each built once."""
    built: dict = {}

    def get(arch: str):
        if arch not in built:
            folder = tmp_path_factory.mktemp(f"beam-{arch}")
            built[arch] = (folder, save_beam_model(arch, folder))
        return built[arch]

    return get


@pytest.fixture(scope="module")
def engines(tiny):
    """(arch, block size, pool) -> one LLM, reused by every case that runs on it. A pool given
    (a small one) comes without the prefix cache, so that an idle pool is all free."""
    built: dict = {}

    def get(arch: str, block_size: int = 16, pool: int | None = None) -> LLM:
        key = (arch, block_size, pool)
        if key not in built:
            built[key] = LLM(
                str(tiny(arch)[0]),
                device="cpu",
                dtype="float32",
                block_size=block_size,
                num_gpu_blocks_override=pool or 256,
                enable_prefix_caching=pool is None,
                max_num_seqs=32,
                debug=True,  # Scheduler.check_invariants() after every step
            )
        return built[key]

    return get


def check_against_transformers(outs, references, params, eos: list[int]) -> None:
    for i, (out, ref, p) in enumerate(zip(outs, references, params, strict=True)):
        where = f"prompt {i} ({p})"
        stops = stop_ids(p, eos)
        assert out.ok, (where, out.error)
        assert ref.margin > MIN_MARGIN, (
            f"{where}: ill-conditioned, transformers' margin {ref.margin:.1e}"
        )
        got = [c.token_ids for c in out.outputs]
        assert got == ref.token_ids, f"{where}: hypotheses differ (margin {ref.margin:.1e})"
        for c, want_score, want_lps in zip(out.outputs, ref.scores, ref.logprobs, strict=True):
            score = c.cumulative_logprob / len(c.token_ids) ** p.length_penalty
            assert score == pytest.approx(want_score, abs=ATOL), where
            stopped = c.token_ids[-1] in stops
            assert c.finish_reason == ("stop" if stopped else "length"), (where, c)
            if not stopped:
                assert len(c.token_ids) == p.max_tokens, (where, c)
            if p.logprobs:
                assert c.logprobs == pytest.approx(want_lps, abs=ATOL), where
                assert c.cumulative_logprob == pytest.approx(f32_sum(c.logprobs), abs=1e-5)
            else:
                assert c.logprobs is None


def beam(width: int = 4, **kw) -> BeamSearchParams:
    return BeamSearchParams(
        **{"beam_width": width, "max_tokens": MAX_TOKENS, "logprobs": True, **kw}
    )


@dataclass(frozen=True)
class Case:
    arch: str = "llama"
    params: tuple[BeamSearchParams, ...] = (beam(),)  # one per prompt, or one for all
    block_size: int = 16
    pool: int | None = None
    prompts: tuple = tuple(map(tuple, PROMPTS))


WIDTH = tuple(map(tuple, WIDTH_PROMPTS))
CASES = {
    # every width, with EOS
    **{f"width-{k}": Case(params=(beam(k),), prompts=WIDTH) for k in (1, 2, 4, 8)},
    # every length penalty with every early-stopping rule, width 4, with EOS
    **{
        f"lp-{lp}-es-{es}": Case("qwen2", (beam(length_penalty=lp, early_stopping=es),))
        for lp in (0.0, 1.0, 2.0)
        for es in (True, False, "never")
    },
    # where the early-stopping rule decides: with this stop token, the three rules give three
    # different sets of hypotheses at length penalty 1 (and True another at 2)
    "early-stopping": Case(
        "llama",
        tuple(
            beam(ignore_eos=True, stop_token_ids=(ES_STOP,), length_penalty=lp, early_stopping=es)
            for lp, es in ((1.0, True), (1.0, False), (1.0, "never"), (2.0, True), (2.0, False))
        ),
        prompts=(tuple(ES_PROMPT),) * 5,
    ),
    # two stop tokens (EOS and another): 3 x width candidates per step
    "two-stops": Case("llama", (beam(2, stop_token_ids=(66,)),), prompts=WIDTH),
    "llama": Case("llama"),
    "qwen3": Case("qwen3"),
    # no EOS: every hypothesis runs to max_tokens
    **{f"{a}-no-eos": Case(a, (beam(ignore_eos=True, logprobs=False),)) for a in EOS},
    "block-64": Case("llama", (beam(8, length_penalty=2.0, early_stopping=True),), block_size=64),
    # groups of different settings side by side in one call
    "mixed": Case(
        "llama",
        (
            beam(2, length_penalty=0.0),
            beam(8, early_stopping="never"),
            beam(4, length_penalty=2.0, early_stopping=True),
        ),
    ),
    # a sliding window (24) shorter than the prompts, beams giving back their old blocks, on a
    # pool that preempts
    "mistral-window-preemption": Case(
        "mistral", (beam(ignore_eos=True),), pool=12, prompts=tuple(map(tuple, PROMPTS))
    ),
    # a pool that cannot hold the three groups at once: whole groups are preempted, resumed
    "preemption": Case(
        "llama",
        (beam(ignore_eos=True),),
        pool=16,
        prompts=tuple(map(tuple, LONG_PROMPTS)),
    ),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_hypotheses_and_scores_match_transformers(tiny, engines, case: Case):
    _, hf = tiny(case.arch)
    eos = [EOS[case.arch]]
    prompts = [list(p) for p in case.prompts]
    params = list(case.params) * (len(prompts) if len(case.params) == 1 else 1)
    llm = engines(case.arch, case.block_size, case.pool)
    before = llm.stats["scheduler"]["num_preemptions"]
    outs = llm.beam_search(prompts, params if len(case.params) > 1 else params[0])
    references = [hf_beam_search(hf, p, bp, eos) for p, bp in zip(prompts, params, strict=True)]
    for ref, p in zip(references, params, strict=True):
        if not stop_ids(p, eos):  # transformers ran without EOS: to max_tokens every time
            assert all(len(t) == p.max_tokens for t in ref.token_ids)
    check_against_transformers(outs, references, params, eos)
    if any(stop_ids(p, eos) for p in params):  # the stop paths were taken
        assert any(c.finish_reason == "stop" for o in outs for c in o.outputs)
    if case is CASES["early-stopping"]:  # the rule made a difference
        assert len({str([c.token_ids for c in o.outputs]) for o in outs[:3]}) == 3
        assert outs[3].outputs != outs[4].outputs
    for out, p in zip(outs, params, strict=True):
        assert len(out.outputs) == p.beam_width
        if p.beam_width > 1:
            assert out.metrics.peak_blocks <= out.metrics.peak_blocks_unshared
    if case.pool is not None:
        assert llm.stats["scheduler"]["num_preemptions"] > before
        assert any(o.metrics.num_preemptions > 0 for o in outs)
        kv = llm.scheduler.kv
        assert kv.num_free_blocks == kv.num_blocks


def test_generate_takes_beam_search_params(tiny, engines):
    """`generate` with BeamSearchParams is `beam_search`."""
    llm = engines("llama")
    p = beam(2, length_penalty=0.5)
    via_generate = llm.generate(PROMPTS[:2], p)
    via_beam_search = llm.beam_search(PROMPTS[:2], p)
    assert [[c.token_ids for c in o.outputs] for o in via_generate] == [
        [c.token_ids for c in o.outputs] for o in via_beam_search
    ]


# ---------------------------------------------------------------- the bundled model

CHATS = [
    "What is the capital of France? Answer in one word.",
    "Name three primary colours.",
    "Write a haiku about the sea.",
]


@pytest.fixture(scope="module")
def smol():
    return LLM(
        bundled_model(),
        device="cpu",
        dtype="float32",
        block_size=16,
        debug=True,
        quantization="none",
    )


def test_bundled_model_beam_search_matches_transformers(smol):
    """SmolLM2-135M-Instruct, width 4, chat prompts: transformers' hypotheses and scores, loaded
    from the same folder in float32; some hypotheses end at EOS."""
    p = BeamSearchParams(beam_width=4, max_tokens=24, logprobs=True)
    outs = smol.chat([[{"role": "user", "content": c}] for c in CHATS], p)
    hf = AutoModelForCausalLM.from_pretrained(smol.source.weights_dir, dtype=torch.float32).eval()
    eos = smol.tracker.eos_token_ids
    references = [hf_beam_search(hf, o.prompt_token_ids, p, eos) for o in outs]
    check_against_transformers(outs, references, [p] * len(outs), eos)
    assert any(c.finish_reason == "stop" for o in outs for c in o.outputs)
    assert "Paris" in outs[0].outputs[0].text


# ---------------------------------------------------------------- block accounting


def assert_ref_counts(llm: LLM) -> None:
    """Every block's reference count is the number of live beams (and other running sequences)
    whose tables hold it; waiting sequences hold nothing; the free count is the rest."""
    sched = llm.scheduler
    holders = Counter(b for seq in sched.running for b in seq.block_table)
    for block in sched.kv.pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0), block
    assert all(not seq.block_table for seq in sched.waiting)
    used = sum(1 for b in sched.kv.pool.blocks if b.ref_cnt > 0)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks - used


def test_blocks_are_counted_through_forks_preemption_and_abort(tiny):
    """Step by step, over beam groups with EOS in a pool too small for all of them: reference
    counts equal holders after every step, groups are preempted, and the pool is all free when
    the run ends; then a second run aborted mid-way, a preempted group among the waiting, leaks
    nothing either."""
    folder, _ = tiny("qwen2")
    llm = LLM(
        str(folder),
        device="cpu",
        dtype="float32",
        block_size=4,
        num_gpu_blocks_override=40,
        enable_prefix_caching=False,
        debug=True,
    )
    params = [beam(4), beam(2, length_penalty=0.0), beam(8, early_stopping="never"), beam(3)]
    prompts = [*LONG_PROMPTS, PROMPTS[1]]
    add = llm.tracker.add
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        assert not add(i, prompt, p, llm.scheduler)
    done, steps = [], 0
    while llm.scheduler.has_unfinished():
        done += llm.step()
        assert_ref_counts(llm)
        steps += 1
        assert steps < 500
    assert sorted(o.index for o in done) == [0, 1, 2, 3] and all(o.ok for o in done)
    assert sum(o.metrics.num_preemptions for o in done) > 0
    kv = llm.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    kv.pool.check_integrity()

    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        add(10 + i, prompt, replace(p, max_tokens=40), llm.scheduler)
    preempted_waiting = False
    for _ in range(60):
        assert not llm.step()
        assert_ref_counts(llm)
        sched = llm.scheduler
        if any(s.beam is not None and s.beam.num_preemptions for s in sched.waiting):
            preempted_waiting = True
            break
    assert preempted_waiting, "no group was waiting after a preemption"
    assert len(llm.scheduler.running) > 1
    assert llm.abort_all() == len(prompts)
    assert not llm.scheduler.has_unfinished() and len(llm.tracker) == 0
    assert kv.num_free_blocks == kv.num_blocks
    kv.pool.check_integrity()
