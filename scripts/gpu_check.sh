#!/usr/bin/env bash
# The GPU checks, on a node with one NVIDIA GPU: versions, the engine tests (fake, the
# bindings' conformance and the real-GPU ones), then the bandwidth benchmark.
#
#     scripts/gpu_check.sh OUTDIR
#
# Works from a source checkout with nothing installed: where the kvd packages are not
# importable, it puts links to them on PYTHONPATH (pyzmq, msgspec, numpy, xxhash,
# uvloop, prometheus-client, redis, cuda-bindings, torch and pytest must be there).
set -u
out=${1:?usage: scripts/gpu_check.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if ! "$py" -c "import kvd_client, kvd_proto, kvd" 2>/dev/null; then
    links=$(mktemp -d)
    ln -s "$PWD/kvd" "$links/kvd"
    ln -s "$PWD/proto" "$links/kvd_proto"
    ln -s "$PWD/client" "$links/kvd_client"
    export PYTHONPATH="$links:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode,pcie.link.gen.current,pcie.link.width.current --format=csv
    "$py" - <<'EOF'
import torch
from cuda import bindings
from kvd_client.cudart import load, version_refusal
api = load()
d, r = api.driver_version(), api.runtime_version()
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), cuda-bindings "
      f"{bindings.__version__}, driver CUDA {d}, bindings' runtime {r}, "
      f"batched copy: {api.has_batch_copy()}")
print("kvd startup check:", version_refusal(d, r) or "accepted")
EOF
    df -h /dev/shm | tail -1
    echo "RLIMIT_MEMLOCK: $(ulimit -l)"
} 2>&1 | tee "$out/versions.txt"

timeout 330 "$py" -m pytest tests/engines -v -rA -p no:cacheprovider \
    --junitxml="$out/pytest.xml" -o timeout=150 2>&1 | tee "$out/pytest.log"
tests=${PIPESTATUS[0]}

timeout 180 "$py" scripts/bench_cuda.py --json > "$out/bench_cuda.json" 2> "$out/bench_cuda.err"
bench=$?
cat "$out/bench_cuda.json" "$out/bench_cuda.err"
echo "tests rc=$tests bench rc=$bench"
[ "$tests" = 0 ] && [ "$bench" = 0 ]
