"""``hetps train``'s side of a worker joining the running job again (``--elastic`` with
``--max-restarts``), a part of :class:`hetps.app.worker.WorkerRun` (``run.rejoin``).
(docs/MODULES.md, "hetps.faults.rejoin")"""

from __future__ import annotations

import io
from fractions import Fraction
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from hetps.kvstore.client import DistKVStore


class Shared(Protocol):
    """A mode's distributed part, as a joiner takes its state over (``run.shared``)."""

    def join_state(self) -> dict: ...
    def adopt(self, state: dict) -> None: ...


class RunPort(Protocol):
    """What :class:`Rejoin` uses of its run (a :class:`hetps.app.worker.WorkerRun`)."""

    kv: DistKVStore  # the worker's store
    model: torch.nn.Module
    device: torch.device
    rank: int
    lead: bool
    #: the mode's distributed part, and the checkpoint's optimizer (``-m esync``)
    shared: Shared | None
    ckpt_opt: torch.optim.Optimizer | None
    first_round: int
    steps_done: int
    epochs_done: Fraction

    #: read the data again from where :attr:`epochs_done` says
    def restart_data(self) -> None: ...


class Rejoin:
    """admit / join of the run ``run`` (a WorkerRun: its kv, model, optimizers, counters and
    data stream)."""

    def __init__(self, run: RunPort) -> None:
        self.run = run

    def admit(self, rnd: int) -> None:
        """Every live worker after round ``rnd``: let the workers that wait to join in; the
        first live worker gives them its model, its data position and its optimizers'."""
        run = self.run
        state = None
        if run.lead:
            buf = io.BytesIO()
            torch.save(
                {
                    "round": rnd,
                    "steps_done": run.steps_done,
                    "epochs_done": run.epochs_done,
                    "model": run.model.state_dict(),
                    "optimizer": run.ckpt_opt.state_dict() if run.ckpt_opt is not None else None,
                    "shared": run.shared.join_state() if run.shared is not None else None,
                },
                buf,
            )
            state = buf.getvalue()
        run.kv.admit(state)
        print(
            f"worker {run.rank}: a worker joined after round {rnd}; "
            f"{run.kv.live_workers} workers from round {rnd + 1}",
            flush=True,
        )

    def join(self) -> None:
        """This worker was started again after it died (the job went on without it): wait
        for the live workers' next round boundary and go on from there with their model
        (call it after ``run.shared`` and the checkpoint's optimizer are set)."""
        run = self.run
        blob = run.kv.join()
        if blob is None:
            raise RuntimeError("joined the running job, but the live workers sent no state")
        state = torch.load(io.BytesIO(blob), map_location=run.device, weights_only=False)
        run.model.load_state_dict(state["model"])
        if (state["shared"] is None) != (run.shared is None):
            raise RuntimeError(
                "joined the running job, but the live workers run another mode (their state "
                f"{'has no' if state['shared'] is None else 'has a'} distributed part)"
            )
        if run.shared is not None:
            run.shared.adopt(state["shared"])
        if run.ckpt_opt is not None and state["optimizer"] is not None:
            run.ckpt_opt.load_state_dict(state["optimizer"])
        run.first_round = int(state["round"])
        run.steps_done = int(state["steps_done"])
        run.epochs_done = Fraction(state["epochs_done"])
        run.restart_data()
        print(
            f"worker {run.rank}: joined the running job after round {run.first_round} "
            f"(is_recovery=1); {run.kv.live_workers} workers",
            flush=True,
        )
