#!/usr/bin/env bash
# The GPU test suites, then the kernel benchmark of both models, on one CUDA machine:
#   benchmarks/gpu.sh OUT_DIR          (from the repository root; about 15 minutes on an H200)
# Needs pagedctl installed from this checkout (`pip install -e '.[test]'`, or `pip install
# --no-deps -e .` over a machine's own torch and triton). The engine suite's bundled-model test
# uses PAGEDCTL_TEST_GGUF (a path to the SmolLM2-135M-Instruct GGUF) or the pulled default model.
# Writes, under OUT_DIR:
#   gpu_tests_kernels.txt   the Triton kernels against the reference (results/gpu_tests_h200.txt)
#   gpu_tests_engine.txt    the engine, CUDA graphs, fused kernels, parity with transformers and
#                           the capacity probe (results/gpu_tests_h200_engine.txt)
#   kernels.md, .json       the kernel benchmark, one run per model merged (results/kernels-h200.*)
# SKIP_TESTS=1 runs the benchmark alone; SHAPES="smollm2-135m" benchmarks one model.
set -u
out="${1:?usage: benchmarks/gpu.sh OUT_DIR}"
mkdir -p "$out"
python3 -c "import pagedctl.engine, pytest" || {
  echo "install pagedctl from this checkout first: pip install -e '.[test]'" >&2
  exit 1
}
commit="${PAGEDCTL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
export PAGEDCTL_COMMIT="$commit" PYTHONUNBUFFERED=1
gpu="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"

suite() {  # suite FILE PYTEST_ARGS...: one GPU suite, its result line on stdout
  local file="$out/$1"
  shift
  echo "# commit $commit, $gpu; pytest -q -m gpu $*" > "$file"
  python3 -m pytest -q -m gpu -p no:cacheprovider "$@" >> "$file" 2>&1
  echo "$(basename "$file"): $(tail -1 "$file")"
}

if [ -z "${SKIP_TESTS:-}" ]; then
  suite gpu_tests_kernels.txt tests/test_kernels_triton_gpu.py
  suite gpu_tests_engine.txt tests --ignore=tests/test_kernels_triton_gpu.py
fi

runs=()
for shape in ${SHAPES:-qwen2.5-0.5b smollm2-135m}; do
  python3 -m benchmarks.kernels --shapes "$shape" --out "$out/$shape" > "$out/$shape.log" 2>&1
  echo "kernels $shape: exit $? ($(grep -c "^| $shape" "$out/$shape/kernels.md" 2>/dev/null) rows)"
  runs+=("$out/$shape/kernels.json")
done
python3 -m benchmarks.kernels --render "${runs[@]}" --out "$out" > /dev/null &&
  echo "tables: $out/kernels.md"
