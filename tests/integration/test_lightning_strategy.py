"""``lightning.Trainer(strategy=hetps.lightning.PSStrategy(...))`` on 2 workers of a real
cluster: in sync mode the weights are those of the same model and data trained with
``DistributedOptimizer``; ``self.log(sync_dist=True)`` is the workers' mean; the sampler
comes from the job; rank 0 writes the checkpoint; esync ends every worker together."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("lightning")

#: importing Lightning takes seconds before a worker registers: room for a busy machine
SLOW_IMPORT = {"HETPS_CONNECT_TIMEOUT": "90"}

COMMON = """
import json, torch, warnings, logging
import lightning as L
import hetps.torch as hvd
from hetps.lightning import PSStrategy
warnings.filterwarnings("ignore")
logging.getLogger("lightning").setLevel(logging.ERROR)
torch.set_num_threads(1)
g = torch.Generator().manual_seed(3)
X, Y = torch.randn(64, 6, generator=g), torch.randn(64, 2, generator=g)
data = torch.utils.data.TensorDataset(X, Y)

def make_model():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))

class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = make_model()
        self.ranks = []
        self.refused = None
    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        # the mean, 0.5 (esync: its workers take different numbers of steps: refused)
        esync = os.environ["MODE"] == "esync"
        self.log("rank", float(self.global_rank), sync_dist=not esync)
        if esync and self.trainer.global_step == 2:  # (the rounds run)
            try:
                self.trainer.strategy.reduce(torch.ones(1))
            except ValueError as exc:
                self.refused = str(exc)
        self.ranks.append(self.trainer.global_rank)
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
"""

SYNC = (
    COMMON
    + """
# the reference: DistributedOptimizer on the same model, data, shards and steps
hvd.init()
r, W = hvd.rank(), hvd.size()
ref = make_model()
opt = hvd.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9),
                               named_parameters=ref.named_parameters(), prefix="ref.")
# (Lightning's training sampler shuffles, seed 0, with the epoch set)
sampler = torch.utils.data.DistributedSampler(data, num_replicas=W, rank=r, shuffle=True)
for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler):
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
opt.close()

module = Module()
ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=os.environ["CKPT"], save_last=True)
trainer = L.Trainer(strategy=PSStrategy(mode="sync"), accelerator="cpu", devices=1,
                    max_epochs=2, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, callbacks=[ckpt])
trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
diff = max((a - b).abs().max().item()
           for a, b in zip(module.net.state_dict().values(), ref.state_dict().values()))
saved = torch.load(ckpt.last_model_path, weights_only=False)["state_dict"]
print("RESULT " + json.dumps({
    "rank": r, "diff": diff, "steps": trainer.global_step,
    "logged": float(trainer.callback_metrics["rank"]),
    "sampler": [type(trainer.train_dataloader.sampler).__name__],
    "ckpt": ckpt.last_model_path,
    "ckpt_diff": max((saved["net." + k] - v).abs().max().item()
                     for k, v in module.net.state_dict().items()),
    "weights": [v.flatten().tolist() for v in module.net.state_dict().values()],
}), flush=True)
"""
)


def _results(out: str) -> dict[int, dict]:
    found = {}
    for line in out.splitlines():
        if "RESULT " in line:
            rec = json.loads(line.split("RESULT ", 1)[1])
            found[rec["rank"]] = rec
    return found


def test_sync_strategy_trains_as_the_distributed_optimizer(cluster, tmp_path):
    ckpt = tmp_path / "ckpt"
    rc, out = cluster(SYNC, workers=2, env={"CKPT": str(ckpt), "MODE": "sync", **SLOW_IMPORT})
    assert rc == 0, out
    res = _results(out)
    assert sorted(res) == [0, 1], out
    for got in res.values():
        assert got["diff"] < 1e-6, got  # the DistributedOptimizer run's weights
        assert got["steps"] == 8  # 64 examples, 2 workers, batches of 8, 2 epochs
        assert got["logged"] == 0.5  # sync_dist: the mean over the workers' ranks
        assert got["sampler"] == ["DistributedSampler"]
        assert got["ckpt_diff"] == 0.0
    assert res[0]["weights"] == res[1]["weights"]
    assert res[0]["ckpt"] == res[1]["ckpt"]  # rank 0 wrote it, every rank knows where
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=1-step=8.ckpt", "last.ckpt"]


ESYNC = (
    COMMON
    + """
module = Module()
trainer = L.Trainer(strategy=PSStrategy(mode=os.environ["MODE"]), accelerator="cpu",
                    devices=1, max_epochs=int(os.environ["EPOCHS"]), logger=False,
                    enable_progress_bar=False, enable_model_summary=False,
                    enable_checkpointing=False)
trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
s = trainer.strategy
print("RESULT " + json.dumps({
    "rank": s.global_rank, "steps": trainer.global_step,
    "rounds": s._esync.rounds if s._esync is not None else None,
    "logged": float(trainer.callback_metrics["rank"]),
    "refused": module.refused,
    "weights": [v.flatten().tolist() for v in module.net.state_dict().values()],
}), flush=True)
"""
)


@pytest.mark.parametrize(
    "mode,epochs",
    [pytest.param("esync", 2, marks=pytest.mark.slow), ("async", 1)],  # (the CI budget)
)
def test_esync_and_async_strategies_train_to_the_end(cluster, mode, epochs):
    # worker 1 runs twice the epochs of worker 0 in esync: worker 0's end ends the job
    rc, out = cluster(
        ESYNC,
        workers=2,
        env={"MODE": mode, "EPOCHS": str(epochs), **SLOW_IMPORT},
        node_env={("worker", 1): {"EPOCHS": str(2 * epochs)}} if mode == "esync" else None,
    )
    assert rc == 0, out
    res = _results(out)
    assert sorted(res) == [0, 1], out
    if mode == "esync":
        # every worker ends after the same round, with the round's averaged weights
        assert res[0]["rounds"] == res[1]["rounds"] >= 1
        assert "different numbers of local steps" in res[0]["refused"]
        assert res[0]["weights"] == res[1]["weights"]
        assert res[0]["steps"] == 8  # its own 2 epochs of 4 batches
    else:
        assert res[0]["steps"] == res[1]["steps"] == 4
        # sync_dist: the mean of the ranks, through the servers (keys they sum: SumKeys)
        assert res[0]["logged"] == res[1]["logged"] == 0.5
