"""ESync's worker side, for your own training script (``hetps train -m esync`` runs it too)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hetps.sync.rules import average_from_sum, esync_update_from_sum, model_delta
from hetps.torch.broadcasting import exchange as broadcast_cpu

if TYPE_CHECKING:
    from hetps.kvstore import KVStore

__all__ = ["ESyncRound", "ESyncTrainer"]


class _FlatExchange:
    """Tensors that travel together: one flat CPU tensor (and KVStore key) per dtype, each
    tensor a view into it. Initial values are copied in."""

    def __init__(self, entries: list[tuple[str, Any]], prefix: str = "") -> None:
        by_dtype: dict[Any, list[tuple[str, Any]]] = {}
        for name, t in entries:
            by_dtype.setdefault(t.dtype, []).append((name, t))
        self.keys: list[str] = []
        self.flats: list[Any] = []
        self._views: dict[str, Any] = {}
        for dtype, items in by_dtype.items():
            flat = torch.empty(sum(t.numel() for _, t in items), dtype=dtype)
            off = 0
            for name, t in items:
                view = flat[off : off + t.numel()].view(t.shape)
                view.copy_(t)
                self._views[name] = view
                off += t.numel()
            self.keys.append(f"{prefix}round:{str(dtype).removeprefix('torch.')}")
            self.flats.append(flat)

    def view(self, name: str) -> Any:
        return self._views[name]


@dataclass
class ESyncRound:
    """What one :meth:`ESyncTrainer.round` did."""

    round: int  #: the round's number, from 1
    local_steps: int  #: local steps this worker took
    outputs: list[Any] = field(default_factory=list)  #: what ``step()`` returned, per step
    stop: bool = False  #: some worker asked to stop after this round
    wait_s: float = 0.0  #: seconds waiting for the state server's first answer
    push_s: float = 0.0  #: seconds exchanging the model difference
    #: a worker waits to join the running job (HETPS_ELASTIC): every worker calls
    #: ``kv.admit(...)`` now, before the next round (docs/ESYNC.md, "ESync from your own script")
    admit: bool = False


class ESyncTrainer:
    """ESync's worker loop around your model and local optimizer.

    Args:
        model: the ``torch.nn.Module`` every worker trains (same architecture everywhere;
            any device). Its parameters start from rank 0's values; its parameters and
            floating-point buffers (BatchNorm statistics) are averaged every round.
        kv: a ``dist_sync`` KVStore (``hetps.kv.create("dist_sync")``).
        global_lr: the aggregation's step, ``w_round + global_lr * sum / K`` (1: the mean).
        state_server: ``"host:port"`` of a standalone ``hetps state-server``; default: the
            one in the scheduler.
        prefix: prepended to this trainer's KVStore keys (two trainers on one store).

    Every worker must call the same methods the same number of times (the aggregation is a
    synchronous round on the servers). docs/ESYNC.md, "ESync from your own script", has an example.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVStore,
        global_lr: float = 1.0,
        state_server: str | None = None,
        prefix: str = "",
    ) -> None:
        from hetps.esync.service import StateClient

        if not hasattr(kv, "node"):
            raise TypeError(
                "ESyncTrainer needs a distributed KVStore (hetps.kv.create('dist_sync')) "
                f"in a cluster, got {type(kv).__name__}"
            )
        self.model = model
        self.kv = kv
        self.global_lr = global_lr
        self.workers = kv.num_workers
        self.params = list(model.named_parameters())
        self.buffers = [(n, b) for n, b in model.named_buffers() if b.dtype.is_floating_point]
        # a worker started again after it died (HETPS_ELASTIC) joins a running job: the keys
        # exist, and its weights come from the live workers (adopt), not from a broadcast
        joiner = bool(getattr(kv, "rejoining", False))
        staged = [p.data.detach().cpu().clone() for _, p in self.params]
        if not joiner:  # every worker starts from rank 0's weights (the KVStore's CPU side)
            broadcast_cpu(kv, [f"{prefix}init:{n}" for n, _ in self.params], staged)
            with torch.no_grad():
                for (_, p), t in zip(self.params, staged, strict=True):
                    p.data.copy_(t)
        # a round's model difference, BatchNorm statistics and control numbers travel as one
        # flat key per dtype (one request per chunk instead of one per tensor), each tensor a
        # view. The control numbers: [the caller's (stop), "a worker waits to join"]
        self._exchange = _FlatExchange(
            [(f"delta:{n}", t) for (n, _), t in zip(self.params, staged, strict=True)]
            + [(f"bn:{n}", b.detach().cpu()) for n, b in self.buffers]
            + [("__ctl", torch.zeros(2, dtype=torch.float32))],
            prefix,
        )
        if joiner:
            kv.declare(self._exchange.keys, self._exchange.flats)
        else:
            kv.init(self._exchange.keys, self._exchange.flats)
        self._deltas = {n: self._exchange.view(f"delta:{n}") for n, _ in self.params}
        self._bn = {n: self._exchange.view(f"bn:{n}") for n, _ in self.buffers}
        self._ctl = self._exchange.view("__ctl")
        self.ctl_total = 0.0  # the sum of the last round's control numbers
        #: a worker waits to join (HETPS_ELASTIC), and some worker saw it in the last round:
        #: every worker calls ``kv.admit`` now (the same answer on every worker)
        self.admit_due = False
        self._state = StateClient(kv.node, state_server)
        self.rounds = 0  #: rounds begun
        self.wait_s = 0.0  #: this round's wait for the state server's first answer
        self.push_s = 0.0  #: this round's model exchange (copies and push-pull)
        #: (start, end) on time.perf_counter() of this round's wait and exchange (the logs' spans)
        self.wait_span: tuple[float, float] | None = None
        self.push_span: tuple[float, float] | None = None
        self._w_round: list[torch.Tensor] = []
        self._t_round = 0.0
        self._deadline: float | None = None
        self._pending: list[Any] = []

    def begin_round(self) -> int:
        """Start a round: remember the weights it starts from; returns its number (from 1)."""
        self.rounds += 1
        self._w_round = [p.data.clone() for _, p in self.params]
        self._t_round = time.perf_counter()
        self._deadline = None  # the round's deadline on this clock, once the state server told
        self._pending = []  # reports sent without waiting
        self.wait_s = 0.0
        self.push_s = 0.0
        self.wait_span = self.push_span = None
        return self.rounds

    def step_done(self, step_s: float) -> bool:
        """Report a local step that computed ``step_s`` seconds; True: take no more local steps
        this round, :meth:`aggregate` now. (docs/MODULES.md, "hetps.esync.trainer")"""
        t0 = time.perf_counter()
        elapsed = t0 - self._t_round
        if self._deadline is None:  # the first step of the round: wait for the answer
            ans = self._state.report(self.rounds, step_s, elapsed)
            self.wait_span = (t0, time.perf_counter())
            self.wait_s += self.wait_span[1] - t0
            if "error" in ans:
                raise RuntimeError(ans["error"])
            if ans.get("ready"):
                return True
            if isinstance(ans.get("deadline_in_s"), (int, float)):
                self._deadline = time.perf_counter() + float(ans["deadline_in_s"])
            return False
        # later steps: report without waiting (the server keeps every estimate), and stop at
        # the deadline or when an answer that came in says ready
        self._pending.append(self._state.report_nowait(self.rounds, step_s, elapsed))
        done = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if f not in done]
        answers = [f.wait(0).body for f in done]
        if any("error" in a for a in answers):
            raise RuntimeError(next(a["error"] for a in answers if "error" in a))
        return any(a.get("ready") for a in answers) or time.perf_counter() + step_s > self._deadline

    def aggregate(self, stop: bool = False, ctl: float | None = None) -> bool:
        """End the round on every worker: push this worker's model difference (and BatchNorm
        statistics), take the global update; returns whether any worker passed ``stop``.

        ``ctl`` (instead of ``stop``): this worker's own control number, summed over the
        workers into :attr:`ctl_total` (``hetps train`` adds its checkpoint wish to it)."""
        t0 = time.perf_counter()
        for (n, p), w0 in zip(self.params, self._w_round, strict=True):
            self._deltas[n].copy_(model_delta(p.data, w0))
        for n, b in self.buffers:
            self._bn[n].copy_(b)
        self._ctl[0] = float(ctl) if ctl is not None else 1.0 if stop else 0.0
        self._ctl[1] = float(self.kv.joining)
        self.kv.pushpull(self._exchange.keys, self._exchange.flats)  # the sums land in place
        self.push_span = (t0, time.perf_counter())
        self.push_s = self.push_span[1] - t0
        self.ctl_total = float(self._ctl[0])
        self.admit_due = float(self._ctl[1]) > 0.5
        # a range that sums fewer workers (one left the job: HETPS_ELASTIC) is scaled to the
        # job's count, so dividing by it below gives those workers' mean
        for k, flat in zip(self._exchange.keys, self._exchange.flats, strict=True):
            for a, b, w in self.kv.short_rounds(k):
                flat.view(-1)[a:b].mul_(self.workers / w)
        with torch.no_grad():
            for (n, p), w0 in zip(self.params, self._w_round, strict=True):
                delta_sum = self._deltas[n].to(p.device)
                p.data.copy_(esync_update_from_sum(w0, delta_sum, self.workers, self.global_lr))
            for n, b in self.buffers:
                b.copy_(average_from_sum(self._bn[n], self.workers))
        return self.ctl_total > 0

    # -- a worker joining a running job (HETPS_ELASTIC) -----------------------------------------
    def join_state(self) -> dict:
        """What a worker that joins the running job needs to go on in step with this one
        (the first live worker gives it at the boundary where it is let in, with the model's
        weights): the rounds begun, which the state server counts too, and the keys the
        model travels in with their sizes (the joiner's must be the same)."""
        return {"rounds": self.rounds, "keys": self._layout()}

    def adopt(self, state: dict) -> None:
        """Take a live worker's :meth:`join_state` (this worker was started again and joined
        the running job): its next round is theirs. The model's weights come apart, from
        the live worker's ``model.state_dict()``; load them too."""
        rounds = state.get("rounds") if isinstance(state, dict) else None
        if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 0:
            raise ValueError(
                "ESyncTrainer.adopt takes what a live worker's ESyncTrainer.join_state() "
                f"gave (a dict with 'rounds' >= 0), got {str(state)[:100]}"
            )
        if state.get("keys") != self._layout():
            raise ValueError(
                f"ESyncTrainer.adopt: the live workers exchange {state.get('keys')}, this "
                f"trainer {self._layout()}: the model (or the prefix) differs"
            )
        self.rounds = rounds

    def _layout(self) -> dict[str, int]:
        return {
            k: f.numel() for k, f in zip(self._exchange.keys, self._exchange.flats, strict=True)
        }

    def round(self, step: Callable[[], Any], stop: bool | Callable[[], bool] = False) -> ESyncRound:
        """One whole round: call ``step()`` (one local step: forward, backward, optimizer
        step) until the state server says to aggregate, then aggregate.

        Each call of ``step`` is timed and reported; its return values are collected in the
        result's ``outputs``. ``stop`` (a bool, or a function asked after the local steps)
        asks every worker to stop after this round; the result's ``stop`` says whether any
        worker did. With network-aware load distribution on (``HETPS_BALANCE``) the round
        starts with ``kv.rebalance()``.
        """
        if getattr(self.kv, "balance", False):
            self.kv.rebalance()
        self.begin_round()
        outputs: list[Any] = []
        while True:
            t0 = time.perf_counter()
            outputs.append(step())
            if self.step_done(time.perf_counter() - t0):
                break
        want = stop() if callable(stop) else bool(stop)
        stopped = self.aggregate(want)
        return ESyncRound(
            round=self.rounds,
            local_steps=len(outputs),
            outputs=outputs,
            stop=stopped,
            wait_s=self.wait_s,
            push_s=self.push_s,
            admit=self.admit_due,
        )
