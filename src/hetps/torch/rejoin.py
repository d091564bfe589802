"""``hetps train``'s side of a worker joining the running job again (``--elastic`` with
``--max-restarts``), as a part of :class:`hetps.app.worker.WorkerRun`.

The live workers agree on a round boundary through a flag summed with a round (``-m sync``:
with the gradients; ``-m esync``: with the model difference). After that round and its
checkpoint each calls :meth:`Rejoin.admit`; the first live worker's state goes to the joiner,
which took no round yet and calls :meth:`Rejoin.join` first.

The state: the model, the data position, the local optimizer's state (``-m esync``: the
checkpoint's optimizer) and the mode's distributed part (``run.shared``: a
:class:`~hetps.torch.optimizer.DistributedOptimizer` or an
:class:`~hetps.esync.trainer.ESyncTrainer`), by its ``join_state`` / ``adopt``.
"""

from __future__ import annotations

import io
from typing import Any

import torch


class Rejoin:
    """admit / join (mixed into WorkerRun, which holds what is used here)."""

    kv: Any
    rank: int
    device: torch.device
    model: torch.nn.Module
    steps_done: int
    epochs_done: float
    first_round: int
    ckpt_opt: Any
    shared: Any
    lead: bool
    _stream: Any
    _data_stream: Any

    def admit(self, rnd: int) -> None:
        """Every live worker after round ``rnd``: let the workers that wait to join in; the
        first live worker gives them its model, its data position and its optimizers'."""
        state = None
        if self.lead:
            buf = io.BytesIO()
            torch.save(
                {
                    "round": rnd,
                    "steps_done": self.steps_done,
                    "epochs_done": self.epochs_done,
                    "model": self.model.state_dict(),
                    "optimizer": self.ckpt_opt.state_dict() if self.ckpt_opt is not None else None,
                    "shared": self.shared.join_state() if self.shared is not None else None,
                },
                buf,
            )
            state = buf.getvalue()
        self.kv.admit(state)
        print(
            f"worker {self.rank}: a worker joined after round {rnd}; "
            f"{self.kv.live_workers} workers from round {rnd + 1}",
            flush=True,
        )

    def join(self) -> None:
        """This worker was started again after it died (the job went on without it): wait
        for the live workers' next round boundary and go on from there with their model
        (call it after ``run.shared`` and the checkpoint's optimizer are set)."""
        blob = self.kv.join()
        if blob is None:
            raise RuntimeError("joined the running job, but the live workers sent no state")
        state = torch.load(io.BytesIO(blob), map_location=self.device, weights_only=False)
        self.model.load_state_dict(state["model"])
        if (state["shared"] is None) != (self.shared is None):
            raise RuntimeError(
                "joined the running job, but the live workers run another mode (their state "
                f"{'has no' if state['shared'] is None else 'has a'} distributed part)"
            )
        if self.shared is not None:
            self.shared.adopt(state["shared"])
        if self.ckpt_opt is not None and state["optimizer"] is not None:
            self.ckpt_opt.load_state_dict(state["optimizer"])
        self.first_round = int(state["round"])
        self.steps_done = int(state["steps_done"])
        self.epochs_done = float(state["epochs_done"])
        self._stream = self._data_stream()
        print(
            f"worker {self.rank}: joined the running job after round {self.first_round} "
            f"(is_recovery=1); {self.kv.live_workers} workers",
            flush=True,
        )
