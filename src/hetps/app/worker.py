"""``hetps train``'s worker: what every mode shares (:class:`WorkerRun`): the data stream, the
timed local step, the stop and checkpoint wishes, the rounds (:meth:`WorkerRun.loop` times
them, writes one JSON line per round (docs/METRICS.md), evaluates on rank 0) and the end of
the run. The loop of each mode is in :mod:`hetps.app.modes`.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hetps.app.checkpointing import TrainCheckpoints, cut_log, last_t
from hetps.app.data import batches, normalize, partition
from hetps.app.rounds import Progress, Round
from hetps.faults.rejoin import Rejoin
from hetps.metrics.records import IterationLog
from hetps.metrics.spans import Spans
from hetps.metrics.traffic import TrafficRecorder, worker_observer

if TYPE_CHECKING:
    from hetps.kvstore import KVStore

__all__ = ["WorkerRun"]


def _evaluate(model: Any, images: Any, labels: Any, batch: int = 500) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(labels), batch):
            x = normalize(images[i : i + batch])  # [B, 1, 28, 28]
            dev = next(model.parameters()).device
            pred = model(x.to(dev)).argmax(1).cpu()
            correct += int((pred == torch.from_numpy(labels[i : i + batch])).sum())
    model.train()
    return correct / max(1, len(labels))


class WorkerRun:
    """One worker's training run, as every mode shares it: its data stream, the timed local
    step (with the ``--slowdown`` emulation), stop conditions, and the round loop that logs.

    Built by :func:`hetps.app.train.train_worker`; a mode creates its optimizers, calls
    :meth:`start` (collective: after every worker's KVStore keys exist), then :meth:`loop`
    and :meth:`finish`.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        kv: KVStore,
        *,
        rank: int,
        device: torch.device,
        slow: float,
        model: torch.nn.Module,
        train_data: tuple[Any, Any, Any],
        test_data: tuple[Any, Any],
        run_dir: Path,
        writer: Any,
        resume: dict | None = None,
    ) -> None:
        self.args = args
        self.kv = kv
        self.rank = rank
        self.device = device
        self.slow = slow
        self.model = model
        self.images, self.labels, self.shard = train_data
        self.test_x, self.test_y = test_data
        self.run_dir = run_dir
        self.writer = writer
        self.params = [(n, p) for n, p in model.named_parameters()]
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.per_epoch = max(1, len(self.shard) // args.batch_size)
        self.computes: list[float] = []  # recent real compute times of one step
        self.steps_done = 0  # the data position: local steps of the run, before a resume too
        self.steps_here = 0  # local steps this process took
        self.run_start = time.time()
        self.traffic: Any = None
        self.spans: Any = None  # hetps.metrics.spans.Spans, from start()
        self.step_end = 0.0  # time.perf_counter() at the end of the last one_step
        self.tboard: Any = None  # hetps.app.tboard.TensorBoardLog with --tensorboard
        self.log: Any = None
        self.progress: Progress | None = None
        # checkpoints (--checkpoint-dir) and a resumed run (--resume): the round and the data
        # position it goes on from
        self.resume = resume
        self.first_round = int(resume["round"]) if resume else 0
        if resume:
            self.steps_done = int(resume["steps_done"])
            torch.set_rng_state(resume["torch_rng"])
        # epochs of data this worker went through: each step adds 1 / steps of its current
        # shard (a shard cut again when a worker leaves or joins has another length), as an
        # exact fraction: a float sum of 1/1000 a thousand times is below 1, one step too many
        self.epochs_done = Fraction(self.steps_done, self.per_epoch)
        # (workers, place among them) the shard was cut for: cut again when it changes
        self._sharded = (kv.num_workers, kv.rank) if kv is not None else (1, 0)
        self.ckpt: Any = None
        self.ckpt_opt: Any = None  # the torch optimizer a checkpoint keeps (set by the mode)
        # the mode's distributed part, which a worker that joins adopts (join_state / adopt):
        # sync's DistributedOptimizer, esync's ESyncTrainer (set by the mode)
        self.shared: Any = None
        if getattr(args, "checkpoint_dir", None):
            self.ckpt = TrainCheckpoints(args, kv, rank)
        self._stream = self._data_stream()
        # a worker joining the running job again, and the live workers letting it in
        self.rejoin = Rejoin(self)

    # -- setup ------------------------------------------------------------------------------
    def start(self) -> None:
        """Wait for every worker, start the clock, the traffic recorder and the logs."""
        kv = self.kv
        if kv is not None:
            kv.init("__ctl", np.zeros(2, np.float32))
            kv.barrier()
        self.run_start = time.time()
        if self.resume is not None:
            # this worker's records after the checkpoint's round go (those rounds are done
            # again), and t goes on from that round's: it counts training, not the time the
            # job was down (a new log: times count from now)
            log = self.run_dir / f"worker-{self.rank}.jsonl"
            cut_log(log, self.first_round)
            self.run_start -= last_t(log)
        elif self.writer is not None:
            self.writer.update(started_at=self.run_start)
        if kv is not None:
            self.traffic = TrafficRecorder(self.run_start)
            # every byte to a server is a push, every byte from one a pull (pulled weights
            # often come back in a push's answer); links are labelled server<rank>
            servers = {s.id: f"server{s.rank}" for s in kv.node.servers()}
            kv.node.observe_traffic(worker_observer(self.traffic, servers))
        self.spans = Spans(self.run_start)
        meter = getattr(kv, "meter", None)  # the live dashboard's timeline (docs/LIVE.md)
        if meter is not None:
            self.spans.sink = meter.add_round
            meter.bind_run(self.run_dir, lead=self.rank == 0)
        self.log = IterationLog(self.run_dir, self.rank)
        if getattr(self.args, "tensorboard", None):
            from hetps.app.tboard import TensorBoardLog

            self.tboard = TensorBoardLog(
                self.args.tensorboard, self.run_dir.name, self.rank, self.run_start
            )
        self.progress = Progress(self.args.progress, self.rank, self.args.time_budget)

    def restore_optimizer(self, opt: Any) -> None:
        """The mode's torch optimizer: kept by checkpoints, restored on a resume."""
        self.ckpt_opt = opt
        if self.resume is not None and self.resume.get("optimizer") is not None:
            opt.load_state_dict(self.resume["optimizer"])

    @property
    def lead(self) -> bool:
        """Whether this worker evaluates and reports for the job: rank 0, or the first live
        worker once rank 0 died and the job went on without it (--elastic)."""
        return self.kv is None or self.kv.live_rank == 0

    def _reshard(self, epoch: int) -> None:
        """After a worker left or joined the job (--elastic): the live workers split the
        whole data again, from the next epoch on."""
        kv = self.kv
        if kv is None:
            return
        now = (kv.live_workers, kv.live_rank)
        if now == self._sharded:
            return
        args = self.args
        self._sharded = now
        self.shard = partition(
            self.labels, now[0], now[1], split_by_class=args.split_by_class, seed=args.seed
        )
        self.per_epoch = max(1, len(self.shard) // args.batch_size)
        print(
            f"worker {self.rank}: from epoch {epoch} on, data shard {now[1]} of {now[0]} "
            f"({len(self.shard)} examples): the job's workers changed",
            flush=True,
        )

    def checkpoint_wish(self) -> bool:
        """Whether this worker asks for a checkpoint after the current round."""
        return self.ckpt is not None and self.ckpt.wish()

    def restart_data(self) -> None:
        """Read the data again from where :attr:`epochs_done` says (a worker that joined)."""
        self._stream = self._data_stream()

    def _data_stream(self):
        args = self.args
        # a resumed run starts where its checkpoint was: the same epochs, in the same order
        first_epoch, skip = divmod(self.steps_done, self.per_epoch)
        for epoch in itertools.count(first_epoch):
            self._reshard(epoch)
            seed = args.seed + self.rank
            epoch_batches = batches(
                self.images, self.labels, self.shard, args.batch_size, seed, epoch, drop_last=True
            )
            for x, y in itertools.islice(epoch_batches, skip if epoch == first_epoch else 0, None):
                yield epoch, x, y

    # -- one local step ---------------------------------------------------------------------
    def one_step(self, opt: Any, opt_step: Callable[[], Any]) -> tuple[float, float, int, int]:
        """Forward, emulated slowdown, backward (``opt.zero_grad()`` first), ``opt_step()``;
        returns (loss, compute seconds, samples, epoch)."""
        epoch, x, y = next(self._stream)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        t0 = time.perf_counter()
        out = self.model(x)
        loss = self.loss_fn(out, y)
        slept = 0.0
        computes = self.computes
        if self.slow > 1 and computes:
            # emulated slower device (--slowdown): sleep (factor - 1) x the median of recent
            # real compute times, and count what was actually slept, so one hiccup is not
            # multiplied into the next sleep
            want = sorted(computes)[len(computes) // 2] * (self.slow - 1)
            ts = time.perf_counter()
            time.sleep(want)
            slept = time.perf_counter() - ts
        opt.zero_grad()
        loss.backward()
        opt_step()
        self.step_end = time.perf_counter()
        dt = self.step_end - t0
        real = max(dt - slept, 1e-6)
        computes.append(real)
        del computes[:-9]
        self.steps_done += 1
        self.steps_here += 1
        self.epochs_done += Fraction(1, self.per_epoch)
        return float(loss.detach()), (dt if self.slow > 1 else real), len(y), epoch

    def want_stop(self, rnd: int, ahead: int = 0) -> bool:
        """Whether the run is over after round ``rnd`` (time budget, epochs of this worker's
        shard, rounds), counting ``ahead`` more local steps than taken so far."""
        args = self.args
        return bool(
            (self.ckpt is not None and self.ckpt.term)  # SIGTERM: stop after this round
            or (args.time_budget is not None and time.time() - self.run_start >= args.time_budget)
            or (
                args.epochs is not None
                and self.epochs_done + Fraction(ahead, self.per_epoch) >= args.epochs
            )
            or (args.max_rounds is not None and rnd >= args.max_rounds)
        )

    # -- the round loop ---------------------------------------------------------------------
    def loop(self, play: Callable[[Round], bool], rebalance: bool = True) -> int:
        """Run rounds until ``play(round)`` (the mode's work) returns True (stop); log each
        round. ``rebalance``: ask for a load-distribution plan at each round's start (when
        the store balances). Returns the number of rounds."""
        kv = self.kv
        rnd = self.first_round
        stop = False
        while not stop:
            rnd += 1
            r = Round(rnd, kv, self.spans)
            if kv is not None and rebalance and kv.balance:
                t0 = time.perf_counter()
                r.plan = kv.rebalance()  # report link measurements, switch to this round's plan
                r.overhead = time.perf_counter() - t0
            stop = play(r)
            self._log_round(r, stop)
            if self.ckpt is not None and self.ckpt.due(rnd, r.checkpoint, stop):
                self.ckpt.save(self, rnd, self.ckpt_opt)
            if r.admit and not stop:  # every collective of this round is done: the boundary
                self.rejoin.admit(rnd)
        if self.ckpt is not None:
            self.ckpt.over = True  # a SIGTERM from now on asks for no checkpoint
        assert self.progress is not None and self.log is not None
        self.progress.close()
        self.log.close()
        if self.tboard is not None:
            self.tboard.close()
        if self.traffic is not None:
            kv.node.observe_traffic(None)
            self.traffic.write(self.run_dir / f"traffic-worker{self.rank}.jsonl")
        return rnd

    def _log_round(self, r: Round, stop: bool) -> None:
        args = self.args
        dur = time.perf_counter() - r.t_iter  # the round itself, without evaluation
        acc, eval_s = None, 0.0
        if self.lead and (r.rnd % max(1, args.eval_duration) == 0 or stop):
            te = time.perf_counter()
            acc = _evaluate(self.model, self.test_x, self.test_y)
            eval_s = time.perf_counter() - te
        sent1, recv1 = self.kv.node.counters.totals() if self.kv is not None else (0, 0)
        phases = r.clock.phases
        rec = {
            "rank": self.rank,
            "iter": r.rnd,
            "epoch": int(r.epoch),
            "t": time.time() - self.run_start,
            "samples": r.samples,
            "loss": float(np.mean(r.losses)),
            "local_steps": r.local_steps,
            **phases,
            "bytes_sent": sent1 - r.sent0,
            "bytes_recv": recv1 - r.recv0,
            "srit_s": dur,
            "eval_s": eval_s,
            "comm_s": phases["push_s"] + phases["pull_s"] + phases["wait_s"],
            "spans": self.spans.take() if self.spans is not None else [],
        }
        if r.plan is not None:
            plan = r.plan
            rec.update(
                overhead_s=r.overhead,
                plan=plan["shares"],
                plan_epoch=plan["epoch"],
                # new probe cycles the planner asked for so far (docs/BALANCE.md §7.3)
                recalibrations=plan.get("recalibrations", 0),
            )
            if "link_matrix" in plan:  # rank 0's answers alone carry it (hetps.balance.wire)
                rec["link_matrix"] = plan["link_matrix"]
        if acc is not None:
            rec["accuracy"] = acc
        assert self.log is not None and self.progress is not None
        self.log.write(rec)
        if self.tboard is not None:
            self.tboard.write(rec)
        self.progress.update(r.rnd, r.samples / max(dur, 1e-9), rec["loss"], acc, rec["t"])

    def finish(self, last: int, barrier: bool = True) -> int:
        """After the last round ``last`` (and the mode's cleanup): wait for every worker
        (``barrier``), say what this process did; returns 0. A resumed run or a worker that
        joined did the rounds after its checkpoint or boundary (``first_round``) only."""
        if self.kv is not None and barrier:
            self.kv.barrier()
        ran = last - self.first_round
        since = f" (rounds {self.first_round + 1}-{last})" if self.first_round else ""
        print(
            f"worker {self.rank} finished {ran} rounds{since} ({self.steps_here} local steps), "
            f"at t={time.time() - self.run_start:.1f}s; logs in {self.run_dir}",
            flush=True,
        )
        return 0
