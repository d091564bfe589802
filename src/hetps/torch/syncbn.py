"""``SyncBatchNorm``: batch normalisation over the whole job's batch (Horovod's
``hvd.SyncBatchNorm``), its statistics summed through the servers.
(docs/MODULES.md, "hetps.torch.syncbn")"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import torch

from hetps.torch.process import store_for

if TYPE_CHECKING:
    from hetps.kvstore import KVStore

__all__ = ["SyncBatchNorm"]

_numbers = itertools.count()


class _SumOverWorkers(torch.autograd.Function):
    """The sum of a flat tensor over the workers; its gradient is summed the same way."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, kv: KVStore, key: str) -> torch.Tensor:
        ctx.kv, ctx.key = kv, key
        out = flat.detach().to("cpu", torch.float64).contiguous()
        kv.pushpull(f"{key}:fwd", out, out=out)
        return out.to(flat.device, flat.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        out = grad.detach().to("cpu", torch.float64).contiguous()
        ctx.kv.pushpull(f"{ctx.key}:bwd", out, out=out)
        return out.to(grad.device, grad.dtype), None, None


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """``torch.nn.BatchNorm{1,2,3}d`` whose training statistics are the whole job's batch's."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.number = next(_numbers)  # names this layer's keys: the same on every worker
        self._kv: KVStore | None = None

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of 2 or more dims, got {input.dim()}")

    def _store(self) -> Any:
        if self._kv is None:
            kv = store_for(None)
            key = f"hvd.syncbn:{self.number}"
            zeros = torch.zeros(3 * self.num_features, dtype=torch.float64)
            kv.init([f"{key}:fwd", f"{key}:bwd"], [zeros, zeros.clone()])
            self._kv = kv
        return self._kv

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise ``input`` (N, C, ...) with the job's batch statistics in training."""
        self._check_input_dim(input)
        kv = store_for(None) if self.training else None
        if kv is None or int(kv.num_workers) == 1:
            return super().forward(input)
        kv = self._store()
        dims = [0, *range(2, input.dim())]
        count = torch.full((self.num_features,), input.numel() / self.num_features)
        local = torch.cat([count.to(input), input.sum(dims), (input * input).sum(dims)])
        total = _SumOverWorkers.apply(local, kv, f"hvd.syncbn:{self.number}")
        n, s, sq = total.split(self.num_features)
        mean = s / n
        var = (sq / n - mean * mean).clamp_min(0)
        if self.track_running_stats and self.running_mean is not None:
            assert self.running_var is not None and self.num_batches_tracked is not None
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m = (
                    1.0 / float(self.num_batches_tracked)
                    if self.momentum is None
                    else self.momentum
                )
                unbiased = var * n / (n - 1).clamp_min(1)
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_(unbiased.detach(), alpha=m)
        shape = [1, self.num_features] + [1] * (input.dim() - 2)
        out = (input - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out
