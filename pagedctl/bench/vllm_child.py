"""The vLLM side of `pagedctl bench`, run in a process of its own by `pagedctl.bench.vllm_peer`.

This file imports nothing of pagedctl: it runs under whichever interpreter has vLLM installed,
often a virtual environment of its own (vLLM pins its own transformers). The model is loaded
once; then each command on stdin (one JSON object a line) runs one timed `LLM.generate`, and
its reply goes, one JSON object a line, to the file descriptor named by argv[2]. vLLM's own
logs go to stdout and stderr, which the parent sends to a log file.

Commands: {"prompts": [[token ids]], "max_tokens": [...], "temperature": t, "ignore_eos": b,
"seed": s or null}; an empty line or EOF ends the process. The first reply says the engine is
ready: {"ready": true, "version", "setup_s", "config"}; each later one {"wall_s",
"token_ids"}; a failure {"error": "..."}.
"""

import json
import os
import sys
import time
import traceback


def _reply(out, doc: dict) -> None:
    out.write(json.dumps(doc) + "\n")
    out.flush()


def _peak_memory() -> dict:
    """This process's peak: CUDA memory reserved where there is a GPU, else resident memory."""
    import resource

    import torch

    if torch.cuda.is_available():
        return {"bytes": torch.cuda.max_memory_reserved(), "kind": "cuda max_memory_reserved"}
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"bytes": kib * 1024, "kind": "peak RSS of the vLLM process"}


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    out = os.fdopen(int(sys.argv[2]), "w")
    try:
        start = time.perf_counter()
        import vllm
        from vllm import LLM, SamplingParams

        kwargs = {
            "model": spec["model"],
            "dtype": spec["dtype"],
            "seed": spec["seed"],
            "load_format": spec["load_format"],
            "skip_tokenizer_init": spec["tokenizer"] is None,
            **spec.get("engine", {}),
        }
        if spec["tokenizer"] is not None:
            kwargs["tokenizer"] = spec["tokenizer"]
        if spec.get("max_model_len"):
            kwargs["max_model_len"] = spec["max_model_len"]
        llm = LLM(**kwargs)
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate([{"prompt_token_ids": list(range(1, 9))}] * 2, warm, use_tqdm=False)
        config = {k: v for k, v in kwargs.items() if k != "model"}
        _reply(out, {"ready": True, "version": vllm.__version__, "config": config,
                     "setup_s": time.perf_counter() - start})  # fmt: skip
    except Exception as e:
        _reply(out, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        return
    for line in sys.stdin:
        if not line.strip():
            break
        cmd = json.loads(line)
        try:
            params = [
                SamplingParams(
                    temperature=cmd["temperature"],
                    max_tokens=m,
                    ignore_eos=cmd["ignore_eos"],
                    seed=cmd.get("seed"),
                    **({"top_k": 0, "top_p": 1.0} if cmd["temperature"] else {}),
                )
                for m in cmd["max_tokens"]
            ]
            prompts = [{"prompt_token_ids": p} for p in cmd["prompts"]]
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            _reply(out, {"wall_s": wall, "token_ids": tokens, "peak_memory": _peak_memory()})
        except Exception as e:
            _reply(out, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})


if __name__ == "__main__":
    main()
