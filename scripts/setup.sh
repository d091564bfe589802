#!/usr/bin/env bash
# Set up a fresh machine for hetps: a virtualenv in .venv with hetps (editable) and every
# extra its examples, tests and benchmarks use; Debian's Fashion-MNIST, iproute2, slurm-wlm,
# munge and prometheus when apt is there and we are root. Safe to run again: it only adds what
# is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
# torch is pinned (extra "torch") to the CPU build this kind of machine carries.
.venv/bin/python -m pip install -q -e ".[torch,plots,balance,metrics,tensorboard,ray,k8s,dev]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import hetps, zmq, msgpack, msgspec, cloudpickle, numpy, torch, scipy, pytest, prometheus_client, rich, tensorboard, ray, kubernetes" \
    || { echo "setup: the virtualenv is incomplete (see pip's output above)" >&2; exit 1; }

need_apt=()
[ -d /usr/share/datasets/fashion-mnist ] || need_apt+=(dataset-fashion-mnist)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
# a one-node Slurm for tests/integration/test_slurm.py (the test starts and stops its daemons)
command -v slurmd >/dev/null 2>&1 || [ -x /usr/sbin/slurmd ] || need_apt+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ] || need_apt+=(munge)
# a real Prometheus server scrapes a job in the live-metrics tests
command -v prometheus >/dev/null 2>&1 || need_apt+=(prometheus)
# a headless browser opens the live dashboard and the report in tests/integration/test_dashboard.py
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need_apt+=(chromium-driver)
if [ ${#need_apt[@]} -gt 0 ]; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}") \
            >/dev/null 2>&1 || echo "setup: could not apt-get install ${need_apt[*]} (tests that need them skip)" >&2
    else
        echo "setup: ${need_apt[*]} missing; install with: sudo apt-get install ${need_apt[*]}" >&2
    fi
fi
echo "setup: ready (.venv)"
