"""pagedctl's benchmarks: the scripts behind the figures in results/ (docs/benchmarks.md).

They live beside the package and are not installed; run them from a checkout with pagedctl
installed (`pip install -e .`), from the repository root:

- `python -m benchmarks.kernels --out DIR`: decode and prefill attention against the card's copy
  bandwidth and against SDPA and flex_attention (CUDA); `--render JSON ...` redraws its tables.
- `python -m benchmarks.step --out DIR`: one engine decode step against its bandwidth floor (CUDA).
- `python -m benchmarks.job OUT_DIR [MODEL]`: a `pagedctl generate` job against the engine it
  drives, on the same requests.
- `python -m benchmarks.startup OUT [--runs 3]`: the whole command of a small job, fresh and run
  again, with the start-up phases of its summary.
- `python -m benchmarks.beam_search`, `python -m benchmarks.scale_out OUT`,
  `python -m benchmarks.threads`: beam search, scale-out and CPU threads (docs/benchmarks.md).
- `benchmarks/gpu.sh OUT_DIR`: the GPU test suites, then the kernel benchmark of both models.

The workloads with peers (`pagedctl bench`, `pagedctl sweep`, `pagedctl capacity`) are commands of
the CLI itself; results/README.md lists which command made each file.
"""
