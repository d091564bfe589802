#!/usr/bin/env bash
# One GPU session: the CUDA tests and every GPU figure, each part under a time limit, the
# results under $OUT (JSON, a junit file, one log). On a 16-core machine with one H100 the
# four parts take about 11.5 minutes at most; a run of at most 10 minutes takes two calls:
#
#   benchmarks/gpu_session.sh tests goals      # about 7 minutes at most
#   benchmarks/gpu_session.sh overlap wire     # about 5 minutes at most
#
# Parts: tests (every CUDA test), goals (benchmarks/gpu_goals.py with the servers on the host,
# then on the GPU), overlap (benchmarks/train_overhead.py --overlap on the GPU), wire
# (benchmarks/wire_goals.py). No part: all four.
#
# Python: $PYTHON (default python3, which must hold torch with CUDA). hetps comes from src/;
# its other needs that the machine lacks (pyzmq, msgspec, cryptography, cffi, pycparser) are
# installed from wheels in .whl/ when that folder is there. Fashion-MNIST comes from
# $HETPS_DATA (default /usr/share/datasets/fashion-mnist); without it the runs train on
# random images of its format (the step times are the same: the data is never looked at).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-session-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
LOG=$OUT/session.log
say() { echo "$*" | tee -a "$LOG"; }

if [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/hetps-site .whl/*.whl || { say "wheels did not install"; exit 2; }
    export PYTHONPATH=/tmp/hetps-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

DATA=${HETPS_DATA:-/usr/share/datasets/fashion-mnist}
if [ ! -e "$DATA/train-images-idx3-ubyte.gz" ] && [ ! -e "$DATA/train-images-idx3-ubyte" ]; then
    DATA=/tmp/hetps-fmnist-random
    "$PY" - "$DATA" <<'PYEOF'
import struct, sys
from pathlib import Path
import numpy as np
root = Path(sys.argv[1]); root.mkdir(parents=True, exist_ok=True)
rng = np.random.default_rng(0)
for prefix, n in (("train", 60000), ("t10k", 10000)):
    (root / f"{prefix}-images-idx3-ubyte").write_bytes(
        struct.pack(">IIII", 0x803, n, 28, 28) + rng.integers(0, 256, (n, 28, 28), np.uint8).tobytes())
    (root / f"{prefix}-labels-idx1-ubyte").write_bytes(
        struct.pack(">II", 0x801, n) + rng.integers(0, 10, n, np.uint8).tobytes())
PYEOF
    say "no Fashion-MNIST at ${HETPS_DATA:-/usr/share/datasets/fashion-mnist}: random images in $DATA"
fi

# part NAME LIMIT_S COMMAND...: run it under its limit, its output into the log
part() {
    local name=$1 limit=$2
    shift 2
    say "== $name (limit ${limit} s): $*"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    say "== $name: exit $rc after $((SECONDS - t0)) s"
}

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests goals overlap wire)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; } \
    >"$OUT/machine.txt" 2>&1
say "machine: $(tr '\n' ' ' <"$OUT/machine.txt")"
for p in "${parts[@]}"; do
    case $p in
    tests)
        part tests 150 "$PY" -m pytest -q -p no:cacheprovider --junitxml="$OUT/tests.xml" \
            tests/integration/test_cuda_paths.py tests/integration/test_cuda_optimizer.py \
            tests/integration/test_device_tensors.py tests/integration/test_server_device.py \
            tests/unit/test_cuda_standin.py tests/unit/test_devices.py \
            tests/unit/test_device_aggregator.py -k "cuda or gpu or standin or device"
        ;;
    goals)
        part goals-host 150 "$PY" benchmarks/gpu_goals.py --gpu 0 --pairs 1 --rounds 60 \
            --data-dir "$DATA" --json "$OUT/gpu_goals_host.json"
        part goals-device 110 "$PY" benchmarks/gpu_goals.py --gpu 0 --pairs 1 --rounds 60 \
            --no-share --server-device cuda:0 --data-dir "$DATA" \
            --json "$OUT/gpu_goals_device.json"
        ;;
    overlap)
        part overlap 100 "$PY" benchmarks/train_overhead.py --overlap --gpu 0 --skip-mxnet \
            --models mlp,lenet --pairs 2 --data-dir "$DATA" --json "$OUT/train_overhead.json"
        ;;
    wire)
        part wire 180 "$PY" benchmarks/wire_goals.py --skip-mxnet --repeats 1 --reps 5 \
            --sizes-mb 64 256 --json "$OUT/wire_goals.json"
        ;;
    *)
        say "unknown part $p (tests, goals, overlap, wire)"
        exit 2
        ;;
    esac
done
