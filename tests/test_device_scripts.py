"""The device scripts that time textual copies of the decode kernel (`scripts/device/variants.py`,
`deal_probe.py`, `timeline.py`) still fit the shipped kernel: every edit's anchor occurs exactly
once in kernels/triton_attention.py, so a change to the kernel cannot leave a copy that silently
times something else (or fails only after a device call has started)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

DEVICE = Path(__file__).resolve().parents[1] / "scripts" / "device"


@pytest.fixture(scope="module")
def device_scripts():
    sys.path.insert(0, str(DEVICE))
    try:
        import deal_probe
        import timeline
        import variants
        from kernel_copy import edited_copy

        yield variants, deal_probe, timeline, edited_copy
    finally:
        sys.path.remove(str(DEVICE))


def test_every_kernel_copy_applies_and_imports(device_scripts) -> None:
    variants, deal_probe, timeline, edited_copy = device_scripts
    copies = {**variants.VARIANTS, **deal_probe.VARIANTS}
    for name, edits in copies.items():
        mod = edited_copy(name, edits)  # asserts each anchor is unique, then imports the copy
        assert hasattr(mod, "paged_attention"), name
    mod = edited_copy("stamped", timeline.EDITS)
    assert hasattr(mod, "paged_attention")


def test_a_stale_anchor_fails_loudly(device_scripts) -> None:
    edited_copy = device_scripts[3]
    with pytest.raises(AssertionError, match="anchor not unique"):
        edited_copy("stale", [("this text is not in the kernel", "")])


def test_w1_probe_runs_the_bench_side_and_splits_its_steps(tmp_path: Path) -> None:
    """`w1_probe.py` on the CPU-sized W1 (the bundled model): the JSON it writes on the device."""
    import json
    import subprocess

    out = tmp_path / "w1.json"
    subprocess.run(
        [sys.executable, str(DEVICE / "w1_probe.py"), str(out), "recipes/nano-bench-cpu.yaml"],
        check=True, cwd=DEVICE.parents[1], capture_output=True, timeout=600,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["output_tok_s"] > 0 and result["plain"]["wall_s"] > 0
    # (its Triton JIT hook only records on a GPU: the CPU path launches no Triton kernel)
    steps = result["synchronised"]["steps"]
    assert steps.get("eager", 0) > 0 and set(result["synchronised"]["ms_by_kind"]) == set(steps)


def test_job_vs_engine_gives_the_job_and_the_engine_the_same_requests(tmp_path: Path) -> None:
    """`job_vs_engine.py` shrunk for the CPU (4 of W1's requests, 8 tokens each; 32 lines of text):
    the job and the engine draw the same number of tokens for the same requests, and the text
    job finishes every line."""
    import json
    import os
    import subprocess

    env = {**os.environ, "JOB_REQUESTS": "4"}
    subprocess.run(
        [sys.executable, str(DEVICE / "job_vs_engine.py"), str(tmp_path)],
        check=True, cwd=DEVICE.parents[1], capture_output=True, timeout=600, env=env,
    )  # fmt: skip
    result = json.loads((tmp_path / "job_vs_engine.json").read_text())
    job, eng, chat = result["w1_job"], result["w1_engine"], result["chat_job"]
    assert job["exit_code"] == 0 and job["ok"] == 4 and job["output_tokens"] == 4 * 8
    assert eng["output_tokens"] == job["output_tokens"]
    assert chat["exit_code"] == 0 and chat["ok"] == chat["requests"] == 32
    again = result["w1_job_again"]
    assert again["exit_code"] == 0 and again["output_tokens"] == job["output_tokens"]
    # the children's Triton JIT records (the CPU path launches no Triton kernel: none)
    assert job["jit"] == {"misses": 0, "misses_in_stream": 0, "seconds_in_stream": 0.0}


def test_the_wgmma_prototype_matches_the_reference_in_the_interpreter() -> None:
    """`swapab_probe.py` under TRITON_INTERPRET=1 checks its decode kernel (dots turned over)
    against the reference op: GQA groups 7, 3 and 1, blocks 16-64, 1-8 splits, NaN in unused
    slots, a sequence of length 0; so the timings it gives on the GPU are of a correct kernel."""
    import os
    import subprocess

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(DEVICE.parents[1])}
    done = subprocess.run(
        [sys.executable, str(DEVICE / "swapab_probe.py")],
        cwd=DEVICE.parents[1], capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("max err") == 4


_SINGLE_SITE_CHECK = """
import sys
import torch
from kernel_copy import edited_copy
import variants
from pagedctl.kernels import reference
from pagedctl.kernels.configs import AttentionConfig

mod = edited_copy("single_site", variants.VARIANTS["single_site"])
torch.manual_seed(0)
cfg = AttentionConfig(16, 32, 4, 1, min_rows=16, fused_combine=True)  # rows 16 >= 2 x GROUP
for dtype, (hq, hkv), splits in ((torch.float16, (14, 2), 3), (torch.float32, (9, 3), 5)):
    lens = torch.tensor([1, 17, 100, 250], dtype=torch.int32)
    k = torch.randn(80, 16, hkv, 64, dtype=dtype)
    v = torch.randn(80, 16, hkv, 64, dtype=dtype)
    table = torch.randperm(80)[:64].reshape(4, 16).to(torch.int32)
    for i, n in enumerate(lens.tolist()):  # NaN in every slot past a sequence's length
        for pos in range(n, 256):
            k[table[i, pos // 16], pos % 16] = float("nan")
            v[table[i, pos // 16], pos % 16] = float("nan")
    q = torch.randn(4, hq, 64, dtype=dtype)
    cu = torch.arange(5, dtype=torch.int32)
    ref = reference.paged_attention(q.float(), k.float(), v.float(), table, lens, cu, 1, 256, 0.125)
    out = mod.paged_attention(q, k, v, table, lens, cu, 1, 256, 0.125, splits, cfg)
    err = (out.float() - ref).abs().max().item()
    print("max err", dtype, hq, hkv, splits, err)
    assert err < (2e-3 if dtype == torch.float16 else 1e-5), err
"""


def test_the_single_store_site_merge_matches_the_reference_in_the_interpreter() -> None:
    """`variants.py single_site` (query heads repeated in the padding rows carry each split's
    log-sum-exp; one store site) is a correct kernel, as results/kernels-variants-h200.txt says:
    against the reference under TRITON_INTERPRET=1, fp16 and fp32, groups 7 and 3, 3 and 5
    splits, NaN in every slot past a sequence's length."""
    import os
    import subprocess

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(DEVICE), str(DEVICE.parents[1])])
    done = subprocess.run(
        [sys.executable, "-c", _SINGLE_SITE_CHECK],
        cwd=DEVICE.parents[1], capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("max err") == 2
