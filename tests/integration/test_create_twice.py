"""``hetps.kv.create`` called twice in one worker process: the same arguments give back the
store the first call made (the process stays one worker of the job, as ps-lite's one
Postoffice per process under MXNet's stores); other arguments are refused with an error that
names the first call's place and how to reuse its store, and the first store goes on."""

from __future__ import annotations

SCRIPT = """
kv = hetps.kv.create('dist_sync')              # FIRST-CALL
again = hetps.kv.create('dist_sync')
print('SAME', again is kv, flush=True)
try:
    hetps.kv.create('dist_async')
except hetps.kv.CreateError as exc:
    print('REFUSED', exc, flush=True)
else:
    print('TAKEN dist_async', flush=True)
kv.init('w', np.zeros(3, np.float32))
again.push('w', np.full(3, kv.rank + 1, np.float32))
print('VALUE', kv.rank, kv.pull('w').tolist(), flush=True)
"""


def test_create_twice_gives_the_same_store_or_names_the_first_call(cluster, tmp_path):
    rc, out = cluster(SCRIPT, workers=2, servers=1)
    assert rc == 0, out
    assert out.count("SAME True") == 2, out
    assert "TAKEN" not in out and "already complete" not in out, out
    said = [line for line in out.splitlines() if "REFUSED " in line]
    assert len(said) == 2, out
    first = f"{tmp_path / 'worker_script.py'}:"
    line = next(i for i, t in enumerate(SCRIPT.splitlines()) if "FIRST-CALL" in t)
    for text in said:
        assert "hetps.kv.create('dist_async'): this process is already a worker" in text, text
        assert f"hetps.kv.create('dist_sync') made at {first}" in text, text
        assert "call hetps.kv.create again with the same arguments" in text, text
    # the first call's own line of the script (the prelude's lines before it)
    where = {text.split(" made at ", 1)[1].split(";", 1)[0] for text in said}
    assert len(where) == 1 and where.pop().endswith(f":{_prelude_lines() + line + 1}"), said
    # both workers' pushes, through either handle, summed in the one store
    for rank in (0, 1):
        assert f"VALUE {rank} [3.0, 3.0, 3.0]" in out, out


def _prelude_lines() -> int:
    from tests.conftest import PRELUDE

    return len(PRELUDE.splitlines())
