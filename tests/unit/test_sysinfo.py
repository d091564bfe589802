"""A node's machine as its reports show it: the process' CPU and resident memory (its CPU
time and /proc), and the machine's GPUs through NVML (skipped, saying why, where the
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


def test_the_last_lines_are_teed_kept_bounded_and_scrubbed(capsys):
    import logging
    import sys

    from hetps.metrics.sysinfo import LOG_KEEP, LOG_WIDTH, LogTail

    tail = LogTail().install()
    log = logging.getLogger("hetps.test_sysinfo")
    handler = logging.StreamHandler(sys.stderr)  # a handler made while the tee is in place
    log.addHandler(handler)
    try:
        print("step 1 at 10.0.0.7:4242")
        print("x" * 1000)
        print("\x1b[31mred\x1b[0m", end="")
        print(" and more")
        log.warning("worker rank 1 (node 9, 127.0.0.1:5555) is late")
        early = tail.take()
        for i in range(LOG_KEEP + 5):
            print(f"line {i}", file=sys.stderr)
    finally:
        log.removeHandler(handler)
        tail.uninstall()
    print("after")  # not kept: the tee is gone
    out, err = capsys.readouterr()
    assert "step 1 at 10.0.0.7:4242" in out and "after" in out  # the output itself unchanged
    assert "127.0.0.1:5555" in err
    lines = tail.last()
    assert len(lines) == LOG_KEEP and lines[-1] == f"line {LOG_KEEP + 4}"
    assert early == ["step 1 at <address>", "x" * LOG_WIDTH, " [31mred [0m and more",
                     "worker rank 1 (node 9, <address>) is late"]  # fmt: skip
    assert tail.take() == lines and tail.take() == []  # the newest, bounded the same way
