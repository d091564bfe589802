"""Fixtures for the namespace tests: skip without root, and fail on anything left behind.

Every test here runs real ``ip netns`` / ``tc`` commands, so the whole directory is skipped
(with the reason) unless we are root on Linux with iproute2 and namespaces work. After every
test the ``no_leftovers`` fixture checks that no namespace created by this test process
remains and that no emulator device appeared in the caller's (root) namespace; if something
is left it is removed and the test fails.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from netem_helpers import OUR_DEVICES, ip_tool, namespaces_with, root_links, skip_reason

from hetps.netem import reap


@pytest.fixture(autouse=True)
def no_leftovers() -> Iterator[None]:
    """Skip without root; after the test assert nothing of ours remains (and remove it)."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    before = root_links()
    yield
    mine = f"hps{os.getpid()}-"
    left = namespaces_with(mine)
    new_devices = sorted(n for n in root_links() - before if OUR_DEVICES.match(n))
    if left:
        for run_id in {n.rsplit("-", 1)[0] for n in left}:
            reap.remove_run(ip_tool(), run_id)
    assert not left, f"namespaces left behind: {left}"
    assert not new_devices, f"emulator devices in the root namespace: {new_devices}"
