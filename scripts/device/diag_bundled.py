"""Which variant of the engine faults on the bundled model (fp32, as test_llm_gpu runs it).

Run from the repository root (it imports the GPU test's prompts from `tests`)."""

import os
import sys
import traceback
from dataclasses import replace

import pagedctl.kernels.configs as configs
from pagedctl.engine import SamplingParams
from pagedctl.engine.llm import LLM

from tests.test_llm_gpu import BUNDLED_PROMPTS  # the GPU test's prompts

variant = sys.argv[1]
if variant == "nofused":
    for k in list(configs.CONFIGS):
        configs.CONFIGS[k] = replace(configs.CONFIGS[k], fused_combine=False)
chats = [[{"role": "user", "content": c}] for c in BUNDLED_PROMPTS]
try:
    llm = LLM(
        os.environ["PAGEDCTL_TEST_GGUF"],
        device="cuda",
        dtype="float32",
        num_blocks=512,
        cuda_graphs=variant != "eager",
    )
    out = [
        o.outputs[0].token_ids[:8]
        for o in llm.chat(chats, SamplingParams(temperature=0.0, max_tokens=64))
    ]
    print(variant, "OK", out[:2])
except Exception:
    print(variant, "FAILED")
    traceback.print_exc(limit=-6)
