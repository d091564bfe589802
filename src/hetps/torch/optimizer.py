"""``DistributedOptimizer``: wrap a torch optimizer so gradients go through the KVStore.
(docs/MODULES.md, "hetps.torch.optimizer")"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from hetps import optim as ps_optim
from hetps.device import staging
from hetps.sync.rules import average_from_sum
from hetps.torch.broadcasting import exchange
from hetps.torch.fusion import (
    FUSION_GAP_S,
    FUSION_SPLIT_BYTES,
    FusionGroup,
    StepTiming,
    plan_groups,
)
from hetps.torch.launching import (
    GroupLauncher,
    kv_takes,
    refuse_graph_capture,
    staged,
    write_after,
)
from hetps.torch.regroup import Regrouping
from hetps.torch.sparse import SparseTables, refuse_sparse, table_weights

__all__ = ["FUSION_GAP_S", "FUSION_SPLIT_BYTES", "DistributedOptimizer", "plan_groups"]

#: steps the hooks time before the groups are re-made (the first one is not used: warm-up)
TUNE_STEPS = 4


def _from_grad_scaler() -> bool:
    """Whether the caller's caller is torch's AMP GradScaler (reading param_groups)."""
    frame = sys._getframe(2)
    return str(frame.f_globals.get("__name__", "")).startswith(("torch.amp", "torch.cuda.amp"))


class DistributedOptimizer(Regrouping):
    """A torch optimizer whose gradients are reduced (or applied) by a hetps KVStore."""

    wire_dtype: torch.dtype | None = None  # gradients travel in it (fp16 compression); None: own

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | None,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        kvstore: Any = None,
        op: str = "average",
        update_on: str = "worker",
        server_optimizer: ps_optim.Optimizer | None = None,
        broadcast: bool = True,
        prefix: str = "",
        fusion_bytes: int | None = None,
        extra: torch.Tensor | None = None,
        tune_steps: int | None = None,
        background_launch: bool = True,
        model: torch.nn.Module | None = None,
        sparse_optimizer: ps_optim.Optimizer | None = None,
        table_init: tuple[float, int] = (0.01, 0),
        overlap_forward: bool = False,
    ) -> None:
        for bad, text in (
            (op not in ("average", "sum"), f"op must be 'average' or 'sum', not {op!r}"),
            (update_on not in ("worker", "server", "sum"),
                f"update_on must be 'worker', 'server' or 'sum', not {update_on!r}"),
            (update_on == "worker" and optimizer is None,
                "update_on='worker' needs a torch optimizer to wrap"),
            (update_on in ("server", "sum") and server_optimizer is None,
                f"update_on={update_on!r} needs server_optimizer (a hetps.optim.Optimizer)"),
            (update_on == "sum" and optimizer is not None,
                "update_on='sum' runs server_optimizer on the workers: pass None as the torch "
                "optimizer (or use update_on='worker' to step a torch optimizer)"),
            (overlap_forward and (update_on == "worker" or model is None or extra is not None),
                "overlap_forward=True needs update_on='server' or 'sum' (the pulls bring the "
                "new weights, or the sum this worker updates with) and model=... (its modules' "
                "forward pre-hooks wait for them), without extra=; got "
                f"update_on={update_on!r}, model={type(model).__name__}, extra={extra is not None}"),
            (fusion_bytes is not None and fusion_bytes < 0,
                f"fusion_bytes must be >= 0 (0 = no fusion), not {fusion_bytes}"),
        ):  # fmt: skip
            if bad:
                raise ValueError(text)
        if kvstore is None or isinstance(kvstore, str):  # None: the process's store
            from hetps.torch.process import store_for  # (never a local one in a launched worker)

            kvstore = store_for(kvstore)
        self.kv = kvstore
        self.optimizer = optimizer
        self.op = op
        self.update_on = update_on
        skip = table_weights(model)  # nn.Embedding(sparse=True)'s: tables, not dense keys
        self.named = [(n, p) for n, p in named_parameters if p.requires_grad and id(p) not in skip]
        # update_on="sum": the servers only sum, this worker runs the update
        self._local = None
        if update_on == "sum":
            from hetps.torch.summation import WorkerUpdate

            assert server_optimizer is not None
            self._local = WorkerUpdate(server_optimizer, self.named)
        names = [n for n, _ in self.named]
        if len(set(names)) != len(names):
            raise ValueError("named_parameters has duplicate names")
        self.prefix = prefix
        self._index = {n: i for i, n in enumerate(names)}
        self._handles: dict[int, Any] = {}  # group index -> its reduction in flight
        self.timing = StepTiming()  # where each step's communication went (hetps train logs it)
        self.named_params = dict(self.named)
        self._overlap = None  # pulls step() left in flight, waited for by each module
        if overlap_forward:
            from hetps.torch.overlap import ForwardWaits

            assert model is not None
            self._overlap = ForwardWaits(model, self.named, self._land, self.timing)
        self._landing: dict[str, torch.Tensor] = {}  # where a lone parameter's reduction lands
        self.synced = False  # synchronize() ran for this gradient (a strategy may reset it)
        self._hooks = []
        for name, p in self.named:
            if not p.is_contiguous():
                raise ValueError(f"parameter {name!r} is not contiguous")
        # what the KVStore exchanges of each parameter: itself on the CPU and on a device the
        # KVStore stages (CUDA: pinned buffers, a side stream), else a CPU copy
        self._cpu = {
            n: (p.data if kv_takes(p.data) else p.data.detach().cpu()) for n, p in self.named
        }
        if fusion_bytes is None:
            fusion_bytes = int(getattr(getattr(self.kv, "cfg", None), "fusion_bytes", 0) or 0)
        if update_on == "server":
            # the servers' optimizer would update a fused group as one tensor, moving the
            # members that had no gradient this step (weight decay, momentum): no fusion
            fusion_bytes = 0
        self.fusion_bytes = fusion_bytes
        if tune_steps is None:
            cfg_steps = getattr(getattr(self.kv, "cfg", None), "fusion_tune_steps", TUNE_STEPS)
            tune_steps = (
                int(cfg_steps)
                if fusion_bytes > 0
                and getattr(self.kv, "type", "") in ("dist_sync", "dist_sync_device")
                and not getattr(self.kv, "balance", False)  # a balance plan covers the key set
                else 0
            )
        if tune_steps < 0:
            raise ValueError(
                f"tune_steps must be >= 0 (0 = never re-make groups), not {tune_steps}"
            )
        self.tune_steps = tune_steps
        self._steps = 0  # synchronized steps so far
        # steps timed: for the groups (a collective) and which groups the hooks send themselves
        self._timing_steps = tune_steps or (TUNE_STEPS if background_launch else 0)
        self._clock: dict[str, float] | None = {} if self._timing_steps else None
        self._timed: list[dict[str, float]] = []  # per timed step: name -> gradient ready time
        # neighbours in backward order, of one dtype and device, <= fusion_bytes each
        entries = [
            (n, p.numel() * p.element_size(), (p.dtype, p.device), None)
            for n, p in reversed(self.named)
        ]
        self.groups = self._as_groups(plan_groups(entries, fusion_bytes))
        self._group_of = {n: g for g in self.groups for n in g.names}
        # a small tensor that rides, summed over the workers, in the group of the first
        # parameters (the last one backward finishes): e.g. a stop flag, without a request
        # of its own. Only in a fused group of its dtype; else the caller sends it itself.
        self.extra = extra
        g0 = self.groups[0] if self.groups else None
        self.extra_rides = bool(
            extra is not None
            and g0 is not None
            and g0.fused
            and extra.dtype == self._wire(g0.names[0])
            and extra.device.type == "cpu"
            and self._cpu[g0.names[0]].device.type == "cpu"
            and extra.is_contiguous()
        )
        if self.extra_rides:
            assert extra is not None and g0 is not None
            g0.numel += extra.numel()
        if broadcast:
            self.broadcast_parameters()
        self.kv.init([self._key(g) for g in self.groups], [self._first(g) for g in self.groups])
        self.tables = SparseTables.of(self, model, sparse_optimizer, table_init)
        if update_on == "server":
            self.kv.set_optimizer(server_optimizer)
        # a launch is ~0.2 ms of Python: a launcher thread does it while backward goes on
        self._launches = GroupLauncher(self._launch, self._handles, self.timing, background_launch)
        # a device the KVStore stages gradients from (CUDA): its copies to the host read
        # the gradients themselves; name -> the staged copy of a lone p.grad last queued
        self._staging = any(staging.backend_for(p.data) is not None for _, p in self.named)
        self._reading: dict[str, Any] = {}
        self._skip_sync = False
        for name, p in self.named:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(name)))
            if staging.backend_for(p.data) is not None:
                self._hooks.append(p.register_hook(self._make_pre_hook(name, p)))

    def _as_groups(self, groups: list[list[str]]) -> list[FusionGroup]:
        """``FusionGroup``s keyed in the parameters' own order, members in that order."""
        params = dict(self.named)
        order = self._index
        groups = sorted(
            (sorted(g, key=order.__getitem__) for g in groups), key=lambda g: order[g[0]]
        )
        return [FusionGroup(i, g, params) for i, g in enumerate(groups)]

    def _wire(self, name: str) -> torch.dtype:  # the dtype ``name``'s gradient travels in
        return self.wire_dtype or self._cpu[name].dtype

    # -- keys -------------------------------------------------------------------------------
    def _key(self, g: FusionGroup) -> str:
        name = g.names[0] if not g.fused else f"{g.names[0]}+{len(g.names) - 1}"
        if g.index == 0 and self.extra_rides:
            name += "+extra"
        return f"{self.prefix}{'weight' if self.update_on == 'server' else 'grad'}:{name}"

    def broadcast_parameters(self) -> None:
        """Give every worker rank 0's parameters (an init on the servers, then a pull)."""
        if self._overlap is not None:
            self._overlap.wait_all()
        keys = [f"{self.prefix}init:{n}" for n, _ in self.named]
        tensors = [self._cpu[n] for n, _ in self.named]
        for (_, p), t in zip(self.named, tensors, strict=True):
            if t is not p.data:
                t.copy_(p.data)
        exchange(self.kv, keys, tensors)
        for (_, p), t in zip(self.named, tensors, strict=True):
            if t is not p.data:
                p.data.copy_(t)

    # -- hooks ------------------------------------------------------------------------------
    def _make_pre_hook(self, name: str, p: torch.Tensor):
        """Before backward adds into ``p.grad`` again (gradient accumulation): the caller's
        stream waits for the staged copy that still reads it (no copy of every gradient)."""

        def pre_hook(grad: torch.Tensor) -> None:
            st = self._reading.get(name)
            if st is not None and p.grad is not None:
                write_after(st, p.grad)

        return pre_hook

    def _make_hook(self, name: str):
        def hook(p: torch.Tensor) -> None:
            if p.grad is None:
                return
            self.synced = False  # a new gradient: the last synchronize() is not this one's
            if self._staging:
                refuse_graph_capture("DistributedOptimizer's gradient hook")
            if self._overlap is not None:
                self._overlap.check_unread(name)  # (raises if a forward read a stale weight)
            if self._clock is not None:
                self._clock[name] = time.perf_counter()
            g = self._group_of[name]  # (re-made groups replace it)
            if g.queued and not self._staging:
                # another backward pass before step() (gradient accumulation) finished this
                # group again while its last launch still waits: send that one first, so the
                # launcher never reads a buffer this pass is refilling (a staged launch reads
                # its own host buffer: the copy into it is waited for on the stream below)
                self.flush_launches()
            refuse_sparse(name, p.grad)  # (a table's gradient: model= makes it one)
            grad = p.grad if kv_takes(p.grad) else p.grad.detach().cpu()
            grad = grad.to(self._wire(name))  # (itself unless compressed)
            if not g.fused:
                # (on a device the copy to the host reads p.grad itself: a second backward
                # before step() adds into it only after that copy, see _make_pre_hook)
                st = staged(grad)
                if isinstance(st, staging.Staged):
                    self._reading[name] = st
                self._launches.send(g, st)
                return
            assert g.send is not None
            write_after(g.staged, g.send)  # the last copy of send read it (accumulation)
            g.staged = None
            g.send_of[name].copy_(grad)
            g.ready.add(name)
            if len(g.ready) == len(g.names):
                g.ready = set()
                self._send_group(g)

        return hook

    def _send_group(self, g: FusionGroup) -> None:
        """Send fused group ``g``'s filled send buffer (staged first on a device)."""
        assert g.send is not None
        st = staged(g.send)
        g.staged = st if isinstance(st, staging.Staged) else None
        self._launches.send(g, st)

    # -- launching ------------------------------------------------------------------------
    def flush_launches(self) -> None:
        """Send the launches queued so far."""
        self._launches.flush()

    def _launch(self, g: FusionGroup, data: torch.Tensor) -> None:
        """Send group ``g``'s gradients (``data``) and ask for its result."""
        if g.index == 0 and self.extra_rides:
            assert self.extra is not None and g.send is not None
            g.send[g.numel - self.extra.numel() :].copy_(self.extra.reshape(-1))
        prio = -self._index[g.names[0]]  # the first layers are needed first by the next forward
        if g.fused:
            out = g.recv
        elif self.update_on != "server":
            # a lone parameter's reduction lands in a buffer of its own, not in p.grad:
            # backward may still add into p.grad (gradient accumulation), and the receive
            # thread must not write into a tensor autograd is updating
            name = g.names[0]
            out = self._landing.get(name)
            if out is None:
                out = self._landing[name] = torch.empty_like(
                    self._cpu[name], dtype=self._wire(name)
                )
        else:
            out = self._cpu[g.names[0]]
        # one request per chunk: the push's answer carries the sum (or the new weights), so a
        # refused push raises here rather than leaving stale values
        self._handles[g.index] = self.kv.pushpull(
            self._key(g), data, out=out, priority=prio, block=False
        )

    # -- torch.optim.Optimizer-like API ---------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every parameter's reduction; afterwards ``p.grad`` holds the reduced
        gradient (update on workers), so it may be clipped before :meth:`step`."""
        if self._overlap is not None:
            self._overlap.wait_all()  # the pulls the last step() left in flight
        params, W = self.named_params, self.kv.num_workers
        t_sync = time.perf_counter()
        self.tables.push()  # embedding tables: the batch's rows' gradients (every step)
        self.flush_launches()
        exchanged = False  # a step without any gradient is not one of the timed steps
        for g in self.groups:
            h = self.take_handle(g, params)
            if h is None:
                continue
            t_wait = time.perf_counter()
            h.wait()
            self.timing.waits.append((t_wait, time.perf_counter()))
            exchanged = True
            if g.fused:  # (update on workers only)
                assert g.recv is not None
                if g.index == 0 and self.extra_rides:
                    assert self.extra is not None
                    k = self.extra.numel()  # the sum over the workers, before any averaging
                    self.extra.copy_(g.recv[g.numel - k :].view_as(self.extra))
                self._reduce(g, g.recv, W)
                for n in g.names:
                    p = params[n]
                    if p.grad is None:
                        # no gradient here (unused in this forward): it stays without one,
                        # as in local training, so the optimizer leaves it alone
                        continue
                    p.grad.copy_(g.recv_of[n])
                continue
            name = g.names[0]
            p = params[name]
            if self.update_on != "server":
                buf = self._landing[name]
                self._reduce(g, buf, W)
                if p.grad.device == buf.device and p.grad.dtype == buf.dtype:
                    # hand the landed tensor over instead of copying it; the old gradient,
                    # which only autograd's last pass wrote, lands the next round
                    self._landing[name], p.grad = p.grad, buf
                else:
                    p.grad.copy_(buf)
            else:
                self._land(g)
        self.synced = True
        self.after_exchange(t_sync, exchanged)

    def _land(self, g: FusionGroup, have: Iterable[str] = ()) -> None:
        """Group ``g``'s pull answered: the new weights into ``p.data`` where the KVStore could
        not land them itself (update_on="server"); under update_on="sum" (overlap_forward) this
        worker's update of the members ``have`` that had a gradient, with the sum."""
        name = g.names[0]
        if self._local is not None:
            buf = g.recv if g.fused else self._landing[name]
            self._reduce(g, buf, self.kv.num_workers)
            for n in have:
                self._local.apply(n, self.named_params[n], g.recv_of[n] if g.fused else buf)
        elif self._cpu[name] is not self.named_params[name].data:
            self.named_params[name].data.copy_(self._cpu[name])

    def after_exchange(self, t_sync: float, exchanged: bool) -> None:
        """A step's reductions are launched (and waited for, unless overlapped): the step
        count, and the timings that tune the groups."""
        for g in self.groups:
            g.ready = set()  # a partial backward must not leave members marked for next step
        self._reading.clear()  # (every launch waited for its copy to the host)
        self.timing.sync = (t_sync, time.perf_counter())
        if not exchanged:
            return
        self._steps += 1
        if self._clock is not None:
            self._timed.append(self._clock)
            self._clock = {}
            if self._steps >= self._timing_steps:  # every worker is at this same step
                self._clock = None
                if self.tune_steps:
                    self._retune()
                else:
                    self._mark_inline()

    def take_handle(self, g: FusionGroup, params: dict) -> Any:
        """Group ``g``'s reduction in flight, launched now if its hooks did not launch it
        (gradients set by hand, members without one); None if it has nothing to send."""
        h = self._handles.pop(g.index, None)
        if h is None:
            # hooks did not run (grads set by hand, or members without a gradient): send now
            have = [n for n in g.names if params[n].grad is not None]
            if not have and not (g.index == 0 and self.extra_rides):
                return None
            if not g.fused:
                self._make_hook(g.names[0])(params[g.names[0]])
            else:
                assert g.send is not None
                write_after(g.staged, g.send)
                g.staged = None
                for n in g.names:
                    if n in g.ready:
                        continue
                    grad = params[n].grad
                    view = g.send_of[n]
                    if grad is None:
                        view.zero_()  # no gradient here: contributes nothing to the sum
                    else:
                        view.copy_(grad)
                self._send_group(g)
            self.flush_launches()
            h = self._handles.pop(g.index)
        return h

    def _reduce(self, g: Any, total: torch.Tensor, W: int) -> None:
        """What the sum becomes before the update: SSGD's mean (op="average"); under
        update_on="sum" the sum scaled as the servers scale it (short rounds only)."""
        if self.update_on == "sum":
            for a, b, w in self.kv.short_rounds(self._key(g)):
                total.view(-1)[a:b].mul_(W / w)
        elif self.op == "average" and W > 1:
            self._mean(g, total, W)  # in place

    def _mean(self, g: Any, total: torch.Tensor, W: int) -> None:
        """The workers' mean from their sum, in place: divided by the job's W, except where
        the round held fewer workers (one left the job: HETPS_ELASTIC)."""
        average_from_sum(total, W, out=total)
        for a, b, w in self.kv.short_rounds(self._key(g)):
            total.view(-1)[a:b].mul_(W / w)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within it, :meth:`step` does not synchronize: it steps on the gradients the
        caller's :meth:`synchronize` reduced and then changed (Horovod's contract, e.g. for
        AMP: ``opt.synchronize(); scaler.unscale_(opt); clip...; with
        opt.skip_synchronize(): scaler.step(opt)``). A step in it without that
        synchronize raises rather than step on this worker's own gradients."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def step(self, closure: Any = None) -> Any:
        """Wait for the reductions (unless :meth:`synchronize` already did), then step."""
        if self._skip_sync and not self.synced:
            raise RuntimeError(
                "step() inside skip_synchronize() but the gradients were not synchronized: "
                "call opt.synchronize() after backward and before skip_synchronize()"
            )
        deferred = self._overlap is not None and not self.synced
        if deferred:  # the next forward waits for the pulls, module by module
            self._overlap.wait_all()  # (what the last forward did not wait for)
            self._overlap.launch_all(self)
        elif not self.synced:
            self.synchronize()
        self.synced = False
        t0 = time.perf_counter()
        loss = None
        if self.update_on == "worker":
            assert self.optimizer is not None
            loss = self.optimizer.step(closure)
        elif self._local is not None:  # the servers summed; this worker updates
            loss = closure() if closure is not None else None
            if not deferred:  # (else each module's forward pre-hook updates its own)
                self._local.step(self.named)
        # (else the servers applied the update; the pulled weights are in place)
        self.timing.update = (t0, time.perf_counter())
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients (of the wrapped optimizer, or of every parameter)."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        else:
            for _, p in self.named:
                p.grad = None
        for g in self.groups:
            g.ready = set()

    @property
    def param_groups(self) -> list[dict]:
        """The wrapped optimizer's parameter groups (for learning-rate schedulers). Read by
        an AMP ``GradScaler`` (its ``unscale_``, also the one ``scaler.step`` makes) before
        :meth:`synchronize`, it synchronizes first: the scaler then unscales the reduced
        sum, not this worker's own gradient that the sum would replace, and finds an inf
        or NaN of any worker, so every worker skips that step alike."""
        if self.tables.entries and _from_grad_scaler():
            self.tables.refuse_scaler()
        if self.update_on != "worker" and _from_grad_scaler():
            raise RuntimeError(
                f"GradScaler with update_on={self.update_on!r}: the pushed gradients are "
                "still scaled and the servers (or this worker's summation update) step on "
                "them before the scaler could unscale them or skip an overflow. Use "
                "update_on='worker' with a GradScaler, or autocast to bfloat16 without one"
            )
        if self.optimizer is None:
            return []
        if not self.synced and self.update_on == "worker" and _from_grad_scaler():
            self.synchronize()
        return self.optimizer.param_groups

    def close(self) -> None:
        """Wait for the pulls in flight (overlap_forward); remove the hooks; stop launching."""
        try:
            if self._overlap is not None:
                self._overlap.close()
        finally:
            for h in self._hooks:
                h.remove()
            self._hooks = []
            self._launches.close()
