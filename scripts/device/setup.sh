# Source me on the device machine: installs the wheels carried in .whl/ and sets the environment.
python3 -c "import gguf, platformdirs" 2>/dev/null ||
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/gguf*.whl .whl/platformdirs*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PAGEDCTL_HOME=/tmp/ph PYTHONUNBUFFERED=1 COLUMNS=160
# The copy's git metadata lags the working tree: start a call with PAGEDCTL_COMMIT=<sha> (the
# commit the working tree is at, here) and the results record it (pagedctl.envinfo, kernels.bench).
echo "${PAGEDCTL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null) (device git metadata)}" > "$OUT/commit.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
