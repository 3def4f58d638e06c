"""Which variant of the engine faults on the bundled model (fp32, as test_llm_gpu runs it)."""

import os
import sys
import traceback
from dataclasses import replace

import kernels.configs as configs
from engine import SamplingParams
from engine.llm import LLM

variant = sys.argv[1]
if variant == "nofused":
    for k in list(configs.CONFIGS):
        configs.CONFIGS[k] = replace(configs.CONFIGS[k], fused_combine=False)
chats = [
    [{"role": "user", "content": c}]
    for c in (
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain what a CPU cache is.",
        "Give me three ideas for a rainy Sunday.",
        "How do I make green tea?",
        "What is 17 times 23?",
        "Translate 'thank you' into German.",
        "Name a famous bridge.",
    )
]
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
