# Source me on the device machine: installs the wheels carried in .whl/ and sets the environment.
python3 -c "import gguf, platformdirs" 2>/dev/null ||
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/gguf*.whl .whl/platformdirs*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PAGEDCTL_HOME=/tmp/ph PYTHONUNBUFFERED=1 COLUMNS=160
git rev-parse --short HEAD > "$OUT/commit.txt" 2>/dev/null || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
