#!/usr/bin/env bash
# Set up a machine for hetps. Safe to run again: it only adds what is missing.
#
#   bash scripts/setup.sh           the main job's needs: a virtualenv in .venv with hetps
#                                   (editable), PyTorch and the extras the examples use
#                                   (plots, metrics); nothing system-wide
#   bash scripts/setup.sh --tests   that, plus what the tests use: every extra (Ray,
#                                   Kubernetes, TensorBoard, Lightning, pytest, ruff) and, as
#                                   root with apt, Debian's dataset-fashion-mnist, iproute2,
#                                   slurm-wlm and munge, prometheus, chromium and
#                                   chromium-driver; a Slurm or Prometheus already on PATH is
#                                   the site's own and is left alone
#   --dry-run                       print what would be installed, install nothing
set -euo pipefail
cd "$(dirname "$0")/.."

tests=0
dry=0
for arg in "$@"; do
    case "$arg" in
        --tests) tests=1 ;;
        --dry-run) dry=1 ;;
        *) echo "setup: unknown option $arg (use --tests, --dry-run)" >&2; exit 2 ;;
    esac
done

extras="torch,plots,metrics"
imports="hetps, zmq, msgpack, msgspec, cloudpickle, numpy, torch, matplotlib, prometheus_client, rich"
if [ $tests = 1 ]; then
    extras="torch,plots,balance,metrics,tensorboard,ray,k8s,lightning,dev"
    imports="$imports, scipy, pytest, tensorboard, ray, kubernetes, lightning"
fi

need_apt=()
if [ $tests = 1 ]; then
    # Fashion-MNIST for hetps train, the Horovod examples and their tests
    [ -d /usr/share/datasets/fashion-mnist ] || need_apt+=(dataset-fashion-mnist)
    command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
    # a one-node Slurm for tests/integration/test_slurm.py (the test starts and stops its
    # daemons); a site's own Slurm (any of its commands on PATH) is used as it is
    if ! command -v slurmd >/dev/null 2>&1 && ! command -v srun >/dev/null 2>&1 \
        && ! command -v sinfo >/dev/null 2>&1; then
        need_apt+=(slurm-wlm)
        command -v munged >/dev/null 2>&1 || need_apt+=(munge)
    fi
    # a real Prometheus server scrapes a job in the live-metrics tests (a site's own is used)
    command -v prometheus >/dev/null 2>&1 || need_apt+=(prometheus)
    # a headless browser opens the live dashboard and the report in the dashboard tests
    command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
    command -v chromedriver >/dev/null 2>&1 || need_apt+=(chromium-driver)
fi

if [ $dry = 1 ]; then
    echo "setup: would pip install -e .[$extras] into .venv"
    echo "setup: would apt-get install: ${need_apt[*]:-nothing}"
    exit 0
fi

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
# torch is pinned (extra "torch") to the CPU build this kind of machine carries.
.venv/bin/python -m pip install -q -e ".[$extras]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import $imports" \
    || { echo "setup: the virtualenv is incomplete (see pip's output above)" >&2; exit 1; }

if [ ${#need_apt[@]} -gt 0 ]; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}") \
            >/dev/null 2>&1 || echo "setup: could not apt-get install ${need_apt[*]} (tests that need them skip)" >&2
    else
        echo "setup: ${need_apt[*]} missing; install with: sudo apt-get install ${need_apt[*]}" >&2
    fi
fi
if [ $tests = 1 ]; then
    echo "setup: ready for the tests (.venv)"
else
    echo "setup: ready (.venv); bash scripts/setup.sh --tests adds what the tests need"
fi
