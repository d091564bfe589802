"""A node's machine as its reports show it: the process' CPU and resident memory (psutil when
installed, else /proc), and the machine's GPUs through NVML (skipped, saying why, where the
NVIDIA driver's library is not there)."""

from __future__ import annotations

import time

import pytest

from hetps.metrics.sysinfo import Sampler, gpus


def test_cpu_and_memory_of_this_process():
    s = Sampler()
    first = s.sample()
    assert 1e6 < first["rss"] < 1e11 and "cpu" not in first  # no rate from one sample
    assert s.sample() == first  # a second within MIN_GAP_S is the same sample
    t0 = time.process_time()
    while time.process_time() - t0 < 0.6:  # this process' own CPU time: 0.6 s of it
        pass
    second = s.sample()
    assert 20 < second["cpu"] <= 100 * 64, second  # percent of one core over the gap
    assert ("gpu" in second) != ("nogpu" in second)


def test_the_machine_s_gpus_through_nvml():
    rows, why = gpus()
    if not rows:
        pytest.skip(f"no GPU to read here: {why}")
    assert why == ""
    for util, used, total in rows:
        assert 0 <= util <= 100 and 0 < used <= total, rows
    got = Sampler().sample()["gpu"]
    assert len(got) == len(rows) and all(g[2] == r[2] for g, r in zip(got, rows, strict=True))
