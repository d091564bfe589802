"""A worker started again joins a running job with embedding tables (HETPS_ELASTIC,
``--max-restarts``): it declares the tables it knows itself, gets from the live workers the
declaration of a table made while it was away, and its row-sparse pushes count in every
round from the boundary on."""

from __future__ import annotations

import io
import json
import re
import sys
import textwrap

import pytest

from conftest import PRELUDE, TEST_ENV
from hetps.launch.local import Launcher, LaunchSpec

# Three workers. Each round every worker pushes (rank + 1) * (r + 1) into row `rank` of
# 'emb' and into row 100 + rank of 'late' (a growing table the live workers declare after
# worker 2 died); with no optimizer a row becomes the round's sum of the pushes of it.
# Worker 2 dies at round DIE_AT, is started again, and joins at a boundary the live workers
# agree on (a flag summed with the round).
SCRIPT = """
import json, pickle
from hetps.tables.rowsparse import Table
die_at = int(os.environ["DIE_AT"])
kv = hetps.kv.create("dist_sync")
kv.init(["probe", "flag"], [np.zeros(1, np.float32), np.zeros(1, np.float32)])
kv.init("emb", Table(40, 2))            # every worker, the joiner too (it sends nothing)
first, stop_at, late = 0, 100000, False
if kv.rejoining:
    state = pickle.loads(kv.join())
    first, stop_at, late = state["next"], state["stop_at"], True
    assert kv.is_row_sparse("late") and kv.table("late").rows is None
    print("JOINED", kv.rank, first, kv.live_workers, flush=True)
seen, flag = [], np.zeros(1, np.float32)
r = first - 1
while r + 1 < stop_at:
    r += 1
    if r == die_at + 1 and not late:
        kv.init("late", Table(None, 2, server_bytes=1 << 20))   # the live workers only
        late = True
    me = np.full((1, 2), (kv.rank + 1) * (r + 1), np.float32)
    if r == die_at and kv.rank == 2 and not kv.node.recovery:
        kv.push("emb", (np.array([kv.rank]), me))
        kv.pull("probe")
        os.kill(os.getpid(), signal.SIGKILL)
    kv.push("emb", (np.array([kv.rank]), me))
    if late:
        kv.push("late", (np.array([100 + kv.rank]), me))
    kv.pushpull("flag", np.array([float(kv.joining)], np.float32), out=flag)
    emb = kv.row_sparse_pull("emb", row_ids=np.arange(3)).data[:, 0].tolist()
    lt = kv.row_sparse_pull("late", row_ids=np.arange(100, 103)).data[:, 0].tolist() if late else []
    seen.append([r, emb, lt, kv.live_workers])
    if flag[0] > 0.5:
        stop_at = r + 6
        kv.admit(pickle.dumps({"next": r + 1, "stop_at": stop_at}))
        seen[-1].append("admitted")
print("SEEN", kv.rank, json.dumps(seen), flush=True)
"""

DIE_AT = 3


def _run(tmp_path, servers: int, code: str = SCRIPT, replicas: int = 1) -> tuple[int, str]:
    script = tmp_path / "table_join.py"
    script.write_text(PRELUDE + textwrap.dedent(code))
    out = io.StringIO()
    spec = LaunchSpec(
        num_workers=3,
        num_servers=servers,
        command=[sys.executable, str(script)],
        env={**TEST_ENV, "DIE_AT": str(DIE_AT)},
        start_timeout=30.0,
        failure_grace=5.0,
        elastic_min=2,
        max_restarts=1,
        rejoin_workers=True,
        replicas=replicas,
    )
    launcher = Launcher(spec, out=out)
    try:
        code = launcher.run()
    finally:
        launcher.stop_all(kill=True)
    return code, out.getvalue()


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_worker_started_again_joins_a_job_with_tables(tmp_path, replicas):
    """Second case: the tables have copies (HETPS_REPLICAS=2), so every push carries its
    round, and the joiner counts its pushes from the round count the live workers give it."""
    code, out = _run(tmp_path, servers=2, replicas=replicas)
    assert code == 0, out
    joined = re.search(r"JOINED 2 (\d+) 3", out)
    assert joined is not None, out
    first = int(joined.group(1))
    assert first > DIE_AT + 1, out  # ('late' was made while it was away)
    seen = {int(k): json.loads(v) for k, v in re.findall(r"SEEN (\d) (\[.*\])", out)}
    assert sorted(seen) == [0, 1, 2], out
    for rank, rounds in seen.items():
        for r, emb, late, live, *_ in rounds:
            f = r + 1.0
            assert emb[:2] == [f, 2 * f], (rank, r, emb)
            if r >= first:  # the joiner's rows in both tables, every round
                assert live == 3 and emb[2] == 3 * f and late == [f, 2 * f, 3 * f], (rank, r)
            elif r > DIE_AT:  # its row keeps the last value it pushed
                assert live == 2 and emb[2] in (3 * DIE_AT, 3 * DIE_AT + 3), (rank, r, emb)
        if rank == 2:
            assert [e[0] for e in rounds] == list(range(first, first + 5)), out
        else:
            assert [e[0] for e in rounds] == list(range(first + 5)), out


# The same through a DistributedOptimizer: nn.Embedding(sparse=True) on the meta device
# (its table on the servers, lazy SGD with the wrapped torch SGD's momentum) and an MLP stepped
# on each worker. Worker 2 draws its ids from rows 30-39 only, the others from 0-29. It dies at
# DIE_AT, is started again, builds its model and optimizer (the table is declared, nothing is
# sent), joins, and takes the first live worker's MLP and optimizer state.
TORCH_SCRIPT = """
import hashlib, pickle
import torch
from torch import nn
from hetps.torch import DistributedOptimizer
die_at = int(os.environ["DIE_AT"])
kv = hetps.kv.create("dist_sync")
r = kv.rank
torch.manual_seed(0)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 4, sparse=True, device="meta")
        self.mlp = nn.Sequential(nn.Linear(8 + 3, 8), nn.ReLU(), nn.Linear(8, 1))
    def forward(self, ids, x):
        return self.mlp(torch.cat([self.emb(ids).reshape(ids.shape[0], -1), x], 1)).squeeze(1)

model = Net()
opt = DistributedOptimizer(torch.optim.SGD(model.mlp.parameters(), lr=0.1, momentum=0.9),
                           model.named_parameters(), kvstore=kv, model=model)
kv.init("flag", np.zeros(1, np.float32))
first, stop_at, boundary = 0, 100000, None
if kv.rejoining:
    state = pickle.loads(kv.join())
    first, stop_at = state["next"], state["stop_at"]
    model.mlp.load_state_dict(state["mlp"])
    opt.adopt(state["shared"])
    print("JOINED", r, first, flush=True)
flag, rnd = np.zeros(1, np.float32), first - 1
lo, hi = (30, 40) if r == 2 else (0, 30)
while rnd + 1 < stop_at:
    rnd += 1
    if rnd == die_at and r == 2 and not kv.node.recovery:
        os.kill(os.getpid(), signal.SIGKILL)
    g = torch.Generator().manual_seed(100 * r + rnd)
    ids = torch.randint(lo, hi, (32, 2), generator=g)
    x, y = torch.randn(32, 3, generator=g), torch.rand(32, generator=g)
    opt.zero_grad()
    nn.functional.mse_loss(model(ids, x), y).backward()
    opt.step()
    kv.pushpull("flag", np.array([float(kv.joining)], np.float32), out=flag)
    if flag[0] > 0.5:
        stop_at = rnd + 6
        boundary = kv.row_sparse_pull("table:emb", row_ids=np.arange(30, 40)).data
        shared = opt.join_state()
        kv.admit(pickle.dumps({"next": rnd + 1, "stop_at": stop_at,
                               "mlp": model.mlp.state_dict(), "shared": shared}))
kv.barrier()
end = kv.row_sparse_pull("table:emb", row_ids=np.arange(30, 40)).data
mlp = np.concatenate([p.detach().numpy().ravel() for p in model.mlp.parameters()])
print("END", r, hashlib.sha256(mlp.tobytes()).hexdigest(), flush=True)
if boundary is not None and r == 0:
    print("MOVED", int(not np.array_equal(boundary, end)), flush=True)
"""


@pytest.mark.slow  # (about 20 s: torch in every worker; the test above is the default run's)
def test_a_worker_started_again_joins_a_distributed_optimizer_with_tables(tmp_path):
    """The joiner's model and optimizer are built as at the start (its table declared, not
    sent again), it takes the live workers' state, and from the boundary on its rows of the
    table move again and every worker steps the same MLP."""
    code, out = _run(tmp_path, servers=2, code=TORCH_SCRIPT)
    assert code == 0, out
    assert re.search(r"JOINED 2 (\d+)", out), out
    ends = re.findall(r"END (\d) (\w+)", out)
    assert sorted(r for r, _ in ends) == ["0", "1", "2"], out
    assert len({digest for _, digest in ends}) == 1, out  # the same MLP on every worker
    assert "MOVED 1" in out, out  # only the joiner touches rows 30-39
