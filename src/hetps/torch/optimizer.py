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
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hetps import optim as ps_optim


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
    ) -> None:
        if op not in ("average", "sum"):
            raise ValueError(f"op must be 'average' or 'sum', not {op!r}")
        if update_on not in ("worker", "server"):
            raise ValueError(f"update_on must be 'worker' or 'server', not {update_on!r}")
        if update_on == "worker" and optimizer is None:
            raise ValueError("update_on='worker' needs a torch optimizer to wrap")
        if update_on == "server" and server_optimizer is None:
            raise ValueError("update_on='server' needs server_optimizer (a hetps.optim.Optimizer)")
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
        self._handles: dict[str, Any] = {}
        self._landing: dict[str, torch.Tensor] = {}  # where each reduction lands
        self._synced = False
        self._hooks = []
        for name, p in self.named:
            if not p.is_contiguous():
                raise ValueError(f"parameter {name!r} is not contiguous")
        # parameters on an accelerator go through CPU staging buffers (the KVStore is CPU-side)
        self._cpu = {
            n: (p.data if p.device.type == "cpu" else p.data.detach().cpu()) for n, p in self.named
        }
        if broadcast:
            self.broadcast_parameters()
        if update_on == "worker":
            self.kv.init(
                [self._gkey(n) for n, _ in self.named],
                [torch.zeros_like(self._cpu[n]) for n, _ in self.named],
            )
        else:
            self.kv.init(
                [self._wkey(n) for n, _ in self.named], [self._cpu[n] for n, _ in self.named]
            )
            self.kv.set_optimizer(server_optimizer)
        for name, p in self.named:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(name)))

    # -- keys -------------------------------------------------------------------------------
    def _gkey(self, name: str) -> str:
        return f"{self.prefix}grad:{name}"

    def _wkey(self, name: str) -> str:
        return f"{self.prefix}weight:{name}"

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
        index = [n for n, _ in self.named].index(name)

        def hook(p: torch.Tensor) -> None:
            if p.grad is None:
                return
            prio = -index  # the first layers are needed first by the next forward pass
            grad = p.grad if p.grad.device.type == "cpu" else p.grad.detach().cpu()
            if self.update_on == "worker":
                # the reduced gradient lands in a buffer of its own, not in p.grad: backward
                # may still add into p.grad (gradient accumulation), and the receive thread
                # must not write into a tensor autograd is updating
                buf = self._landing.get(name)
                if buf is None:
                    buf = self._landing[name] = torch.empty_like(grad)
                self._handles[name] = self.kv.pushpull(
                    self._gkey(name), grad, out=buf, priority=prio, block=False
                )
            else:
                push = self.kv.push(self._wkey(name), grad, priority=prio, block=False)
                pull = self.kv.pull(
                    self._wkey(name), out=self._cpu[name], priority=prio, block=False
                )
                # wait on both: a refused push must raise, not leave stale weights
                self._handles[name] = type(pull)(
                    list(push.futures) + list(pull.futures), pull.timeout, "push+pull", pull.wait
                )

        return hook

    # -- torch.optim.Optimizer-like API ---------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every parameter's reduction; afterwards ``p.grad`` holds the reduced
        gradient (update on workers), so it may be clipped before :meth:`step`."""
        for name, p in self.named:
            h = self._handles.pop(name, None)
            if h is None:
                if p.grad is None:
                    continue
                # the hook did not run (e.g. grads set by hand): reduce now
                self._make_hook(name)(p)
                h = self._handles.pop(name)
            h.wait()
            if self.update_on == "worker":
                buf = self._landing[name]
                if self.op == "average" and self.kv.num_workers > 1:
                    buf.div_(self.kv.num_workers)
                if p.grad.device == buf.device and p.grad.dtype == buf.dtype:
                    # hand the landed tensor over instead of copying it; the old gradient,
                    # which only autograd's last pass wrote, lands the next round
                    self._landing[name], p.grad = p.grad, buf
                else:
                    p.grad.copy_(buf)
            elif self._cpu[name] is not p.data:
                p.data.copy_(self._cpu[name])
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

    @property
    def param_groups(self) -> list[dict]:
        """The wrapped optimizer's parameter groups (for learning-rate schedulers)."""
        return self.optimizer.param_groups if self.optimizer is not None else []

    def close(self) -> None:
        """Remove the gradient hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
