"""How local are the block tables the engine makes? `python3 scripts/table_locality.py [OUT.json]`

The kernel bench times attention through a random block table against an identity one
(`results/kernels-tables-h200.md`: a random table costs up to 4% at batch 8 x 32K, runs of 8
consecutive blocks 2-3%, runs of 64 about 1%, whole 2 MB pages nothing). This drives the engine's
own scheduler, KV manager and block pool (no model: one made-up token per row and step, as
`pagedctl bench scheduler` does) through a W1-like stream with churn, and measures the tables of
the running sequences every so often:

  adjacent  the share of neighbouring table entries that are neighbouring block ids (either way)
  run       mean length of the runs of neighbouring ids (a random table: 1; runs of 8: 8)
  page      the share of neighbouring entries in the same 2 MB page of a layer's K (or V) pool
  pages/seq distinct pages a sequence's table touches, against the fewest its blocks could fill

Pages: `PAGE_BYTES // block_bytes` blocks, the block's bytes for one layer's K at Qwen2.5-0.5B's
shape (2 KV heads x 64 dims x bf16): 4 KB at block 16, 512 blocks a page.
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
import sys
from pathlib import Path

from pagedctl.engine import CacheConfig, SamplingParams, Scheduler, SchedulerConfig, Sequence
from pagedctl.kernels.sweep_access import PAGE_BYTES

from pagedctl.bench.scheduler import _fake_tokens

KV_BYTES_PER_TOKEN_LAYER_K = 2 * 64 * 2  # Qwen2.5-0.5B: 2 KV heads x 64 dims x bf16


def table_stats(tables: list[list[int]], page_blocks: int) -> dict:
    """Locality figures of block tables (see the module docstring)."""
    pairs = adjacent = same_page = 0
    runs: list[int] = []
    pages_ratio = []
    for t in tables:
        if len(t) < 2:
            continue
        run = 1
        for a, b in itertools.pairwise(t):
            pairs += 1
            if abs(b - a) == 1:
                adjacent += 1
                run += 1
            else:
                runs.append(run)
                run = 1
            same_page += a // page_blocks == b // page_blocks
        runs.append(run)
        fewest = -(-len(t) // page_blocks)
        pages_ratio.append(len({b // page_blocks for b in t}) / fewest)
    return {
        "tables": len(pages_ratio),
        "adjacent": adjacent / max(pairs, 1),
        "run": statistics.fmean(runs) if runs else 0.0,
        "page": same_page / max(pairs, 1),
        "pages_per_seq_vs_fewest": statistics.fmean(pages_ratio) if pages_ratio else 0.0,
    }


def simulate(
    *,
    num_requests: int,
    max_num_seqs: int,
    num_blocks: int,
    block_size: int = 16,
    prompt_len: tuple[int, int] = (100, 1024),
    output_len: tuple[int, int] = (100, 1024),
    prefix_caching: bool = True,
    snapshots: int = 6,
    seed: int = 0,
) -> dict:
    """Run the stream to its end; table figures of the running sequences at `snapshots` moments
    spread over it (by requests finished), and the pool's size and block bytes."""
    rng = random.Random(seed)
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=max_num_seqs, max_model_len=4096),
        CacheConfig(
            block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching
        ),
    )
    for _ in range(num_requests):
        prompt = [rng.randrange(3, 32000) for _ in range(rng.randint(*prompt_len))]
        params = SamplingParams(max_tokens=rng.randint(*output_len), ignore_eos=True)
        sched.add(Sequence(prompt, params, eos_token_id=2))
    block_bytes = block_size * KV_BYTES_PER_TOKEN_LAYER_K
    page_blocks = PAGE_BYTES // block_bytes
    marks = {num_requests * (i + 1) // (snapshots + 1) for i in range(snapshots)}
    done, steps, shots = 0, 0, []
    while sched.has_unfinished():
        out = sched.schedule()
        done += len(sched.update(out, _fake_tokens(out, rng)))
        steps += 1
        if done in marks:
            marks.discard(done)
            tables = [list(s.block_table) for s in sched.running]
            shots.append({"finished": done, "step": steps, **table_stats(tables, page_blocks)})
    return {
        "num_requests": num_requests,
        "max_num_seqs": max_num_seqs,
        "num_blocks": num_blocks,
        "block_size": block_size,
        "block_bytes": block_bytes,
        "page_blocks": page_blocks,
        "prefix_caching": prefix_caching,
        "steps": steps,
        "snapshots": shots,
    }


def main() -> None:
    cases = {
        # W1's H200 pool (675,641 blocks): far more than the stream ever holds at once
        "W1 stream, H200-sized pool": dict(num_requests=2048, max_num_seqs=256, num_blocks=675_641),
        # a pool only a little larger than the running set: blocks are reused all the time
        "W1 stream, tight pool": dict(num_requests=2048, max_num_seqs=256, num_blocks=20_000),
        "tight pool, no prefix caching": dict(
            num_requests=2048, max_num_seqs=256, num_blocks=20_000, prefix_caching=False
        ),
    }
    results = {}
    for name, kw in cases.items():
        r = simulate(**kw)
        results[name] = r
        print(f"{name}: {r['num_blocks']:,} blocks, {r['steps']:,} steps")
        for s in r["snapshots"]:
            print(
                f"  after {s['finished']:5d} finished: {s['tables']:3d} tables, adjacent "
                f"{s['adjacent']:.3f}, run {s['run']:6.1f}, same page {s['page']:.3f}, pages "
                f"{s['pages_per_seq_vs_fewest']:.1f}x the fewest"
            )
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
