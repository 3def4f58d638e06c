"""Packed bfloat16 projections on the CPU (`kernels.onednn`): the same bits as `F.linear` for
every row count, bias or none, strided rows; only bfloat16 CPU weights are packed; an engine
with packed weights gives the tokens of one without."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagedctl import kernels
from pagedctl.kernels import onednn

needs_onednn = pytest.mark.skipif(
    not onednn.packs(torch.zeros(1, 1, dtype=torch.bfloat16)), reason="torch built without oneDNN"
)


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 7, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_f_linear_bit_for_bit(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(1536, 576, generator=gen).to(torch.bfloat16)
    b = torch.randn(1536, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, 600, generator=gen).to(torch.bfloat16)[:, 7:583]  # strided rows
    packed = kernels.pack_linear_weight(weight)
    assert packed is not None
    assert torch.equal(kernels.packed_linear(x, packed, b), F.linear(x, weight, b))


def test_only_bfloat16_cpu_weights_are_packed() -> None:
    for dtype in (torch.float32, torch.float16):
        assert kernels.pack_linear_weight(torch.zeros(4, 4, dtype=dtype)) is None
    meta = torch.empty(4, 4, dtype=torch.bfloat16, device="meta")
    assert kernels.pack_linear_weight(meta) is None


@needs_onednn
def test_an_engine_with_packed_weights_gives_the_same_tokens(tmp_path: Path) -> None:
    from pagedctl.engine import LLM, SamplingParams
    from pagedctl.engine.models.layers import Linear
    from tests.tiny_models import save_tiny_model

    save_tiny_model("qwen2", tmp_path)  # q/k/v biases
    llm = LLM(str(tmp_path), device="cpu", dtype="bfloat16", max_num_seqs=8)
    linears = [m for m in llm.runner.model.modules() if isinstance(m, Linear)]
    assert all(m.packed is not None for m in linears)
    assert llm.memory["weights_bytes"] > sum(p.nbytes for p in llm.runner.model.parameters())
    prompts = [[(7 * i + j) % 256 for j in range(5 + 3 * i)] for i in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    packed = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    for m in linears:
        m.packed = None
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == packed
