"""``hetps train``'s modes: one loop each, over what every mode shares (:class:`WorkerRun`).
(docs/MODULES.md, "hetps.app.modes")"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from hetps import optim as ps_optim
from hetps.app.checkpointing import decode, encode
from hetps.app.rounds import Round, account_step
from hetps.app.worker import WorkerRun
from hetps.esync.trainer import ESyncTrainer
from hetps.torch.optimizer import DistributedOptimizer

__all__ = ["RUNNERS", "run_async", "run_esync", "run_local", "run_sync"]


def run_local(run: WorkerRun) -> int:
    """``-m local``: plain SGD in one process."""
    opt = torch.optim.SGD(run.model.parameters(), lr=run.args.learning_rate)
    run.restore_optimizer(opt)
    run.start()

    def play(r: Round) -> bool:
        r.add_step(*run.one_step(opt, opt.step))
        r.checkpoint = run.checkpoint_wish()
        return run.want_stop(r.rnd)  # each worker stops on its own

    return run.finish(run.loop(play))


def run_sync(run: WorkerRun) -> int:
    """``-m sync``: SSGD; the servers sum the gradients, every worker steps with the mean."""
    kv = run.kv
    # summed over the workers each step: [stop and checkpoint wishes, "a worker waits to join"]
    stop_flag = torch.zeros(2, dtype=torch.float32)
    dopt = DistributedOptimizer(
        torch.optim.SGD(run.model.parameters(), lr=run.args.learning_rate),
        run.params,
        kvstore=kv,
        op="average",
        extra=stop_flag,
    )
    run.shared = dopt
    run.start()
    if kv.rejoining:  # started again after it died: in from the live workers' next boundary
        run.rejoin.join()

    def play(r: Round) -> bool:
        # "stop after this round?" (and "checkpoint?", and "a worker waits to join") travel
        # with the gradients, not in a round of their own
        ctl = np.array(
            [encode(run.want_stop(r.rnd, ahead=1), run.checkpoint_wish()), float(kv.joining)],
            np.float32,
        )
        ctl_handle = None
        if dopt.extra_rides:
            dopt.extra.copy_(torch.from_numpy(ctl))  # rides with the gradients, summed
        else:
            ctl_handle = kv.pushpull("__ctl", ctl, block=False)
        loss, c, n, epoch = run.one_step(dopt, lambda: None)
        # the hooks pushed during backward; step() waits for the pulls
        t1 = time.perf_counter()
        dopt.step()
        account_step(r, dopt.timing.take(), t1, time.perf_counter())
        r.add_step(loss, c, n, epoch, end=run.step_end)
        if ctl_handle is not None:
            ctl_handle.wait()
            total = ctl.tolist()
        else:
            total = dopt.extra.tolist()  # summed over the workers by step()
        stop, r.checkpoint = decode(total[0])
        r.admit = total[1] > 0.5  # a worker waits to join: in after this round (and its checkpoint)
        return stop

    rounds = run.loop(play)
    dopt.close()
    return run.finish(rounds)


def run_async(run: WorkerRun) -> int:
    """``-m async``: ASGD (``-dcasgd 1``: DC-ASGD); the servers update on every push."""
    args = run.args
    name = "dcasgd" if args.use_dcasgd else args.server_optimizer  # (registered names)
    extra = {"lamda": 0.04} if name == "dcasgd" else {}
    server_opt = ps_optim.create(name, learning_rate=args.learning_rate, **extra)
    overlap = bool(getattr(args, "overlap_forward", False))
    dopt = DistributedOptimizer(
        None,
        run.params,
        kvstore=run.kv,
        update_on="server",
        server_optimizer=server_opt,
        # --overlap-forward: step() leaves the pulls in flight; each layer's forward
        # (evaluation's too) waits for its own parameters, a checkpoint's state_dict for all
        model=run.model if overlap else None,
        overlap_forward=overlap,
    )
    run.start()

    def play(r: Round) -> bool:
        loss, c, n, epoch = run.one_step(dopt, lambda: None)
        t1 = time.perf_counter()
        dopt.step()  # waits for the new weights (with --overlap-forward: the next forward)
        account_step(r, dopt.timing.take(), t1, time.perf_counter())
        r.add_step(loss, c, n, epoch, end=run.step_end)
        return run.want_stop(r.rnd)  # each worker stops on its own

    rounds = run.loop(play, rebalance=False)
    dopt.close()
    return run.finish(rounds, barrier=False)


def run_esync(run: WorkerRun) -> int:
    """``-m esync``: local steps until the state server says ready, then the model
    difference is averaged (:class:`~hetps.esync.trainer.ESyncTrainer`)."""
    args = run.args
    local_opt = torch.optim.SGD(run.model.parameters(), lr=args.local_lr)
    endpoint = (
        f"{args.state_server_ip}:{args.state_server_port}"
        if args.state_server_ip and args.state_server_port
        else None
    )
    # (a worker started again after it died makes no broadcast: it joins below)
    trainer = ESyncTrainer(run.model, run.kv, global_lr=args.global_lr, state_server=endpoint)
    run.restore_optimizer(local_opt)
    run.shared = trainer
    run.start()
    if run.kv.rejoining:  # in from the live workers' next boundary, with their state
        run.rejoin.join()

    def play(r: Round) -> bool:
        trainer.begin_round()
        while True:
            loss, c, n, epoch = run.one_step(local_opt, local_opt.step)
            r.add_step(loss, c, n, epoch)
            if trainer.step_done(c):  # the state server's word: aggregate now
                break
        r.clock.add("wait_s", trainer.wait_s, trainer.wait_span and trainer.wait_span[1])
        trainer.aggregate(ctl=encode(run.want_stop(r.rnd), run.checkpoint_wish()))
        stop, r.checkpoint = decode(trainer.ctl_total)
        r.admit = trainer.admit_due  # a worker waits to join: in after this round (and ckpt)
        r.clock.add("push_s", trainer.push_s, trainer.push_span and trainer.push_span[1])
        return stop

    return run.finish(run.loop(play))


RUNNERS: dict[str, Callable[[WorkerRun], int]] = {
    "esync": run_esync,
    "sync": run_sync,
    "async": run_async,
    "local": run_local,
}
