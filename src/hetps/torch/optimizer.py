"""``DistributedOptimizer``: wrap a torch optimizer so gradients go through the KVStore.

The Horovod/BytePS contract: a post-accumulate-grad hook on every parameter starts a
non-blocking push (and the matching pull) as soon as that parameter's gradient is ready, while
backward is still running; ``step()`` waits for them and applies the result;
``synchronize()`` does the waiting alone, so gradients can be clipped before ``step()``.

Two places to update:

* ``update_on="worker"`` (default): servers sum the gradients (``dist_sync`` with no server
  optimizer), every worker pulls the sum, divides by the number of workers for
  ``op="average"`` and steps the wrapped optimizer locally (SSGD).
* ``update_on="server"``: a :mod:`hetps.optim` optimizer runs on the servers; workers push
  gradients and pull the new weights (``dist_async`` gives ASGD, with ``optim.DCASGD``
  DC-ASGD). The wrapped torch optimizer may be None then.

Parameters are keyed by name in the order given (the same on every worker), and the initial
weights are broadcast from rank 0.

Tensor fusion: every request costs the same fixed time whatever its size (a message each way,
Python on both ends), so gradients smaller than ``fusion_bytes`` (default
``HETPS_FUSION_BYTES``, 256 KiB) travel together: neighbouring parameters, in the order
backward produces them, form groups of at most ``fusion_bytes``; each member's hook copies its
gradient into the group's flat buffer and the last one to arrive sends the group as one key.
Larger gradients go alone, without a copy. ``fusion_bytes=0`` sends every parameter alone.
Fusion applies to ``update_on="worker"`` only (a server-side optimizer would update a group
as one tensor). A member with no gradient this step (unused by the forward pass) adds zeros
and keeps ``p.grad`` None; its group then goes out from :meth:`synchronize`, after backward.
As with lone parameters, a parameter must get a gradient on every worker or on none.

``extra``: a small tensor (e.g. a "stop after this step?" flag) that travels inside the
first parameters' fused group and comes back summed over the workers after
:meth:`synchronize`, so it costs no request of its own. Set it before backward (the group
may leave from a hook); ``extra_rides`` says whether it
could (a fused group of its dtype), otherwise the caller must exchange it itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hetps import optim as ps_optim


class _Group:
    """Parameters whose gradients travel as one key (one member: no fusion, no copy)."""

    __slots__ = (
        "index",
        "names",
        "offsets",
        "numel",
        "send",
        "recv",
        "ready",
        "send_of",
        "recv_of",
    )

    def __init__(self, index: int, names: list[str], params: dict[str, torch.Tensor]) -> None:
        self.index = index
        self.names = names
        self.offsets: dict[str, tuple[int, int]] = {}
        n = 0
        for name in names:
            k = params[name].numel()
            self.offsets[name] = (n, n + k)
            n += k
        self.numel = n
        self.send: torch.Tensor | None = None  # flat buffers of a fused group
        self.recv: torch.Tensor | None = None
        self.ready: set[str] = set()
        # each member's view into send / recv, made once (slicing per step costs ~5 us each)
        self.send_of: dict[str, torch.Tensor] = {}
        self.recv_of: dict[str, torch.Tensor] = {}

    def make_buffers(self, dtype: torch.dtype, like: dict[str, torch.Tensor]) -> None:
        """The flat send/receive buffers of a fused group and each member's views."""
        self.send = torch.zeros(self.numel, dtype=dtype)
        self.recv = torch.empty_like(self.send)
        self.send_of = {n: self.view(self.send, n, like[n]) for n in self.names}
        self.recv_of = {n: self.view(self.recv, n, like[n]) for n in self.names}

    @property
    def fused(self) -> bool:
        return len(self.names) > 1

    def view(self, flat: torch.Tensor, name: str, like: torch.Tensor) -> torch.Tensor:
        a, b = self.offsets[name]
        return flat[a:b].view_as(like)


class DistributedOptimizer:
    """A torch optimizer whose gradients are reduced (or applied) by a hetps KVStore."""

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
    ) -> None:
        if op not in ("average", "sum"):
            raise ValueError(f"op must be 'average' or 'sum', not {op!r}")
        if update_on not in ("worker", "server"):
            raise ValueError(f"update_on must be 'worker' or 'server', not {update_on!r}")
        if update_on == "worker" and optimizer is None:
            raise ValueError("update_on='worker' needs a torch optimizer to wrap")
        if update_on == "server" and server_optimizer is None:
            raise ValueError("update_on='server' needs server_optimizer (a hetps.optim.Optimizer)")
        if fusion_bytes is not None and fusion_bytes < 0:
            raise ValueError(f"fusion_bytes must be >= 0 (0 = no fusion), not {fusion_bytes}")
        if kvstore is None or isinstance(kvstore, str):
            import hetps.kv

            kvstore = hetps.kv.create(kvstore or "local")
        self.kv = kvstore
        self.optimizer = optimizer
        self.op = op
        self.update_on = update_on
        self.named = [(n, p) for n, p in named_parameters if p.requires_grad]
        names = [n for n, _ in self.named]
        if len(set(names)) != len(names):
            raise ValueError("named_parameters has duplicate names")
        self.prefix = prefix
        self._index = {n: i for i, n in enumerate(names)}
        self._handles: dict[int, Any] = {}  # group index -> its reduction in flight
        self._landing: dict[str, torch.Tensor] = {}  # where a lone parameter's reduction lands
        self._synced = False
        self._hooks = []
        for name, p in self.named:
            if not p.is_contiguous():
                raise ValueError(f"parameter {name!r} is not contiguous")
        # parameters on an accelerator go through CPU staging buffers (the KVStore is CPU-side)
        self._cpu = {
            n: (p.data if p.device.type == "cpu" else p.data.detach().cpu()) for n, p in self.named
        }
        if fusion_bytes is None:
            fusion_bytes = int(getattr(getattr(self.kv, "cfg", None), "fusion_bytes", 0) or 0)
        if update_on == "server":
            # the servers' optimizer would update a fused group as one tensor, moving the
            # members that had no gradient this step (weight decay, momentum): no fusion
            fusion_bytes = 0
        self.fusion_bytes = fusion_bytes
        self.groups = self._make_groups(fusion_bytes)
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
            and extra.dtype == self._cpu[g0.names[0]].dtype
            and extra.device.type == "cpu"
            and extra.is_contiguous()
        )
        if self.extra_rides:
            assert extra is not None and g0 is not None
            g0.numel += extra.numel()
        if broadcast:
            self.broadcast_parameters()
        keys, values = [], []
        for g in self.groups:
            if g.fused:
                g.make_buffers(self._cpu[g.names[0]].dtype, self._cpu)
                if update_on == "server":
                    for n in g.names:
                        g.send_of[n].copy_(self._cpu[n])
                values.append(g.send)
            elif update_on == "worker":
                values.append(torch.zeros_like(self._cpu[g.names[0]]))
            else:
                values.append(self._cpu[g.names[0]])
            keys.append(self._key(g))
        self.kv.init(keys, values)
        if update_on == "server":
            self.kv.set_optimizer(server_optimizer)
        for name, p in self.named:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(name)))

    def _make_groups(self, fusion_bytes: int) -> list[_Group]:
        """Groups of neighbours in backward order (the reverse of the parameters' order), each
        of one dtype and device and at most ``fusion_bytes``; big parameters alone."""
        params = {n: p for n, p in self.named}
        groups: list[list[str]] = []
        cur: list[str] = []
        cur_bytes = 0
        for name, p in reversed(self.named):
            nbytes = p.numel() * p.element_size()
            fits = (
                cur
                and nbytes + cur_bytes <= fusion_bytes
                and p.dtype == params[cur[0]].dtype
                and p.device == params[cur[0]].device
            )
            if fits:
                cur.append(name)
                cur_bytes += nbytes
                continue
            if cur:
                groups.append(cur)
            cur, cur_bytes = [name], nbytes
            if nbytes >= fusion_bytes:  # too big to share: goes alone
                groups.append(cur)
                cur, cur_bytes = [], 0
        if cur:
            groups.append(cur)
        # keyed in the parameters' own order; members in that order inside a group
        order = {n: i for i, (n, _) in enumerate(self.named)}
        groups = sorted(
            (sorted(g, key=order.__getitem__) for g in groups), key=lambda g: order[g[0]]
        )
        return [_Group(i, g, params) for i, g in enumerate(groups)]

    # -- keys -------------------------------------------------------------------------------
    def _gkey(self, name: str) -> str:
        return f"{self.prefix}grad:{name}"

    def _wkey(self, name: str) -> str:
        return f"{self.prefix}weight:{name}"

    def _key(self, g: _Group) -> str:
        name = g.names[0] if not g.fused else f"{g.names[0]}+{len(g.names) - 1}"
        if g.index == 0 and self.extra_rides:
            name += "+extra"
        return self._gkey(name) if self.update_on == "worker" else self._wkey(name)

    def broadcast_parameters(self) -> None:
        """Give every worker rank 0's parameters (an init on the servers, then a pull)."""
        keys = [f"{self.prefix}init:{n}" for n, _ in self.named]
        tensors = [self._cpu[n] for n, _ in self.named]
        for (_, p), t in zip(self.named, tensors, strict=True):
            if t is not p.data:
                t.copy_(p.data)
        self.kv.init(keys, tensors)
        self.kv.pull(keys, out=tensors)
        for (_, p), t in zip(self.named, tensors, strict=True):
            if t is not p.data:
                p.data.copy_(t)

    # -- hooks ------------------------------------------------------------------------------
    def _make_hook(self, name: str):
        g = self._group_of[name]

        def hook(p: torch.Tensor) -> None:
            if p.grad is None:
                return
            grad = p.grad if p.grad.device.type == "cpu" else p.grad.detach().cpu()
            if not g.fused:
                self._launch(g, grad)
                return
            assert g.send is not None
            g.send_of[name].copy_(grad)
            g.ready.add(name)
            if len(g.ready) == len(g.names):
                self._launch(g, g.send)

        return hook

    def _launch(self, g: _Group, data: torch.Tensor) -> None:
        """Send group ``g``'s gradients (``data``) and ask for its result."""
        g.ready = set()
        if g.index == 0 and self.extra_rides:
            assert self.extra is not None and g.send is not None
            g.send[g.numel - self.extra.numel() :].copy_(self.extra.reshape(-1))
        prio = -self._index[g.names[0]]  # the first layers are needed first by the next forward
        if g.fused:
            out = g.recv
        elif self.update_on == "worker":
            # a lone parameter's reduction lands in a buffer of its own, not in p.grad:
            # backward may still add into p.grad (gradient accumulation), and the receive
            # thread must not write into a tensor autograd is updating
            name = g.names[0]
            out = self._landing.get(name)
            if out is None:
                out = self._landing[name] = torch.empty_like(data)
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
        params = dict(self.named)
        W = self.kv.num_workers
        for g in self.groups:
            h = self._handles.pop(g.index, None)
            if h is None:
                # hooks did not run (grads set by hand, or members without a gradient): send now
                have = [n for n in g.names if params[n].grad is not None]
                if not have and not (g.index == 0 and self.extra_rides):
                    continue
                if not g.fused:
                    self._make_hook(g.names[0])(params[g.names[0]])
                else:
                    assert g.send is not None
                    for n in g.names:
                        if n in g.ready:
                            continue
                        grad = params[n].grad
                        view = g.send_of[n]
                        if grad is None:
                            view.zero_()  # no gradient here: contributes nothing to the sum
                        else:
                            view.copy_(grad)
                    self._launch(g, g.send)
                h = self._handles.pop(g.index)
            h.wait()
            if g.fused:  # (update on workers only)
                assert g.recv is not None
                if g.index == 0 and self.extra_rides:
                    assert self.extra is not None
                    k = self.extra.numel()  # the sum over the workers, before any averaging
                    self.extra.copy_(g.recv[g.numel - k :].view_as(self.extra))
                if self.op == "average" and W > 1:
                    g.recv.div_(W)
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
            if self.update_on == "worker":
                buf = self._landing[name]
                if self.op == "average" and W > 1:
                    buf.div_(W)
                if p.grad.device == buf.device and p.grad.dtype == buf.dtype:
                    # hand the landed tensor over instead of copying it; the old gradient,
                    # which only autograd's last pass wrote, lands the next round
                    self._landing[name], p.grad = p.grad, buf
                else:
                    p.grad.copy_(buf)
            elif self._cpu[name] is not p.data:
                p.data.copy_(self._cpu[name])
        for g in self.groups:
            g.ready = set()  # a partial backward must not leave members marked for next step
        self._synced = True

    def step(self, closure: Any = None) -> Any:
        """Wait for the reductions (unless :meth:`synchronize` already did), then step."""
        if not self._synced:
            self.synchronize()
        self._synced = False
        if self.update_on == "worker":
            assert self.optimizer is not None
            return self.optimizer.step(closure)
        return None  # the servers applied the update; the pulled weights are in place

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
        """The wrapped optimizer's parameter groups (for learning-rate schedulers)."""
        return self.optimizer.param_groups if self.optimizer is not None else []

    def close(self) -> None:
        """Remove the gradient hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
