"""A secured job (``hetps launch`` made its secret): an outsider gets no message in.

The outsider (tests/security/forger.py) tries the scheduler, the server and both workers,
plain and with CURVE keys of its own (guessing the server's key, and with the job's public key
as if it had leaked): registration, pushes, inits, pulls, pickled optimizers and states,
``exit``, ``leave``, ``drop``, ``node_dead``, barrier releases. Every connection is refused at
its handshake, before any message is read: no receiver logs a single message from it, each
logs every refused handshake, the job's values are exactly an undisturbed run's, and the
outsider's pickle never ran.
"""

from __future__ import annotations

import re

from .test_identity import job_code


def test_an_outsider_without_the_secret_gets_no_message_into_a_secured_job(cluster, tmp_path):
    marker = tmp_path / "outsider-ran"
    rc, out = cluster(job_code(marker, "curve"), workers=2, servers=1)
    assert rc == 0, out
    assert out.count("JOB-OK") == 2, out
    assert not marker.exists()
    assert "FORGER got" not in out, out  # not even a refusal: its registration never arrived
    assert int(re.search(r"FORGER sent (\d+)", out).group(1)) > 300
    # no message of the outsider was read anywhere (what is refused from worker rank 1 is
    # the insider's part of the script, over its own connections)
    for text in ("from a connection of no node of this job", "dropped a bad message", "refused "):
        hits = [
            ln
            for ln in out.splitlines()
            if text in ln and "refused a connection" not in ln and "from worker rank 1" not in ln
        ]
        assert not hits, hits
    # every receiver refused each way the outsider connected (one line per refused handshake)
    for who in ("scheduler", "server 0", "worker 0", "worker 1"):
        lines = [ln for ln in out.splitlines() if ln.startswith(f"[{who}]")]
        handshakes = [ln for ln in lines if "refused a connection at its handshake" in ln]
        zap = [ln for ln in lines if "it does not hold this job's cluster secret" in ln]
        assert handshakes and zap, (who, out)
