"""HETPS_OPTIMIZERS: a server told which registered optimizers it takes unpickles only those
classes, by reference. A worker's pickle that would run code on the server (a ``__reduce__``
calling ``os.system``), a class pickled by value and a registered class not listed are each
refused with an error naming HETPS_OPTIMIZERS, nothing of them runs, and the server goes on
with a listed optimizer."""

from __future__ import annotations

SCRIPT = """
kv = hetps.kv.create('dist_sync')
kv.init('w', np.zeros(4, np.float32))

class Forged(optim.Optimizer):     # its pickle calls os.system where it is loaded
    def __reduce__(self):
        return (os.system, ('touch ' + os.environ['MARKER'],))

class Mine(optim.SGD):             # a class of __main__: pickled by value
    pass

for bad in (Forged(), Mine(learning_rate=1.0), optim.Adam()):
    try:
        kv.set_optimizer(bad)
    except RequestError as exc:
        print('REFUSED', type(bad).__name__, exc, flush=True)
    else:
        print('TAKEN', type(bad).__name__, flush=True)
kv.set_optimizer(optim.SGD(learning_rate=0.5))
kv.push('w', np.ones(4, np.float32))
assert kv.pull('w').tolist() == [-0.5] * 4, kv.pull('w')
print('ALLOWLIST-OK', flush=True)
"""


def test_a_server_takes_only_the_listed_optimizers(cluster, tmp_path):
    marker = tmp_path / "ran-on-the-server"
    env = {"HETPS_OPTIMIZERS": "sgd,dcasgd", "MARKER": str(marker)}
    rc, out = cluster(SCRIPT, workers=1, servers=1, env=env)
    assert rc == 0, out
    assert "ALLOWLIST-OK" in out, out
    assert not marker.exists(), "the forged pickle ran on the server"
    for name, named in (
        ("Forged", "posix.system"),
        ("Mine", "cloudpickle.cloudpickle._make_skeleton_class (a class pickled by value)"),
        ("Adam", "hetps.optim.adam.Adam"),
    ):
        said = [line for line in out.splitlines() if f"REFUSED {name} " in line]
        assert said, (name, out)
        assert (
            f"the optimizer's pickle names {named}, and this server takes only dcasgd, sgd "
            in (said[0])
        ), said
        assert "(HETPS_OPTIMIZERS)" in said[0]
    assert "TAKEN" not in out, out


STATES = """
import pickle
kv = hetps.kv.create('dist_sync')
kv.init('w', np.zeros(4, np.float32))
kv.set_optimizer(optim.SGD(learning_rate=0.5, momentum=0.9))

class Forged:                      # a state whose pickle calls os.system where it is loaded
    def __reduce__(self):
        return (os.system, ('touch ' + os.environ['MARKER'],))

forged = os.environ['MARKER'] + '.states'
with open(forged, 'wb') as f:
    f.write(pickle.dumps({'format': 'hetps-optimizer-states', 'version': 1,
                          'states': {('w', 0): Forged()}}))
try:
    kv.load_optimizer_states(forged)
except RequestError as exc:
    print('REFUSED', exc, flush=True)
else:
    print('TAKEN', flush=True)
kv.push('w', np.ones(4, np.float32))
kv.pull('w')
saved, again = forged + '.1', forged + '.2'
kv.save_optimizer_states(saved)    # the states a server wrote are taken back
kv.push('w', np.ones(4, np.float32))
kv.pull('w')
kv.load_optimizer_states(saved)
kv.save_optimizer_states(again)
a, b = (optim.load_states(open(p, 'rb').read()) for p in (saved, again))
assert a.keys() == b.keys() and a, (a, b)
for k in a:
    assert a[k]['mom'].tolist() == b[k]['mom'].tolist() != [0.0] * 4, (k, a[k], b[k])
print('STATES-OK', flush=True)
"""


def test_a_server_that_takes_only_listed_optimizers_loads_no_code_from_states(cluster, tmp_path):
    """load_optimizer_states sends a worker's pickle too: under HETPS_OPTIMIZERS=names the
    server builds NumPy arrays and numbers from it, nothing else (nothing of it runs)."""
    marker = tmp_path / "ran-on-the-server"
    env = {"HETPS_OPTIMIZERS": "sgd", "MARKER": str(marker)}
    rc, out = cluster(STATES, workers=1, servers=1, env=env)
    assert not marker.exists(), "the forged states' pickle ran on the server"
    assert rc == 0, out
    said = [line for line in out.splitlines() if "REFUSED " in line]
    assert said, out
    assert "set_states: the optimizer states' pickle names posix.system" in said[0], said
    assert "(HETPS_OPTIMIZERS)" in said[0], said
    assert "STATES-OK" in out and "TAKEN" not in out, out


DEFAULT = """
kv = hetps.kv.create('dist_sync')
kv.init('w', np.zeros(4, np.float32))

class Mine(optim.SGD):             # a class of __main__: pickled by value
    pass

try:
    kv.set_optimizer(Mine(learning_rate=1.0))
except RequestError as exc:
    print('REFUSED', exc, flush=True)
else:
    print('TAKEN Mine', flush=True)
kv.set_optimizer(optim.Adam(learning_rate=0.5))   # registered: taken by reference
kv.push('w', np.ones(4, np.float32))
assert np.allclose(kv.pull('w'), -0.5, atol=1e-3), kv.pull('w')
from hetps.optim.sums import SumKeys               # hetps' wrapper: taken, its inner checked
try:
    kv.set_optimizer(SumKeys(Mine(learning_rate=1.0)))
except RequestError as exc:
    print('WRAPPED-REFUSED', exc, flush=True)
else:
    print('TAKEN wrapped Mine', flush=True)
kv.set_optimizer(SumKeys(optim.SGD(learning_rate=1.0)))
kv.init('hvd.n', np.zeros(2, np.float32))
kv.push('hvd.n', np.full(2, 3, np.float32))
kv.push('w', np.ones(4, np.float32))
assert kv.pull('hvd.n').tolist() == [3, 3], kv.pull('hvd.n')
assert np.allclose(kv.pull('w'), -1.5, atol=1e-3), kv.pull('w')
print('DEFAULT-OK', flush=True)
"""


def test_by_default_a_server_takes_only_registered_optimizers(cluster, monkeypatch):
    """With no HETPS_OPTIMIZERS a server takes every registered optimizer and refuses a
    class of the worker's script, naming the class, the variable and both fixes."""
    monkeypatch.delenv("HETPS_OPTIMIZERS", raising=False)
    rc, out = cluster(DEFAULT, workers=1, servers=1)
    assert rc == 0, out
    assert "DEFAULT-OK" in out and "TAKEN" not in out, out
    said = [line for line in out.splitlines() if "REFUSED " in line]
    assert said, out
    assert "set_optimizer: __main__.Mine is refused: " in said[0], said
    assert (
        "takes only adagrad, adam, dcasgd, sgd (HETPS_OPTIMIZERS=registered, the default)"
        in (said[0])
    ), said
    assert 'register its class with @optimizer("name")' in said[0], said
    assert "or set HETPS_OPTIMIZERS=any on the servers" in said[0], said
    wrapped = [line for line in out.splitlines() if "WRAPPED-REFUSED " in line]
    assert wrapped and "__main__.Mine is refused: " in wrapped[0], out
