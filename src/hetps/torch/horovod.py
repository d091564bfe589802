"""Horovod's ``DistributedOptimizer`` signature over hetps's (:mod:`hetps.torch.optimizer`).

``hetps.torch.DistributedOptimizer`` takes both forms: Horovod's keywords (``compression``,
``op``, ``gradient_predivide_factor``, ``backward_passes_per_step``) and hetps's
``kvstore=``; README.md, "A Horovod, BytePS or Lightning script", says what each does."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hetps.torch.collectives import Adasum, Average, Compression
from hetps.torch.optimizer import DistributedOptimizer as _Base

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer(_Base):
    """hetps's ``DistributedOptimizer`` that also takes Horovod's and BytePS's arguments."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | None,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
        kvstore: Any = None,
        op: str = Average,
        *,
        compression: Any = Compression.none,
        backward_passes_per_step: int = 1,
        gradient_predivide_factor: float = 1.0,
        **kwargs: Any,
    ) -> None:
        wire = getattr(compression, "wire_dtype", False)
        n = backward_passes_per_step
        n_ok = isinstance(n, int) and not isinstance(n, bool) and n >= 1
        for bad, text in (
            (op == Adasum, "op=hvd.Adasum is Horovod's adaptive summation; hetps's servers sum: "
                "use op=hvd.Average (the default) or op=hvd.Sum"),
            (wire is False, f"compression={compression!r}: DistributedOptimizer takes "
                "hvd.Compression.none or hvd.Compression.fp16"),
            (not n_ok, f"backward_passes_per_step must be an int >= 1, not {n!r}"),
        ):  # fmt: skip
            if bad:
                raise ValueError(text)
        factor = float(gradient_predivide_factor)  # (after those: it raises for a non-number)
        for bad, text in (
            (not factor > 0, f"gradient_predivide_factor must be > 0, not {factor}"),
            (factor != 1.0 and op != Average,
                "gradient_predivide_factor applies to op=hvd.Average only"),
            ((wire is not None or factor != 1.0 or (n_ok and n > 1))
                and kwargs.get("update_on", "worker") != "worker",
                "compression, gradient_predivide_factor and backward_passes_per_step work on "
                "the gradients a worker steps with: they need update_on='worker'"),
        ):  # fmt: skip
            if bad:
                raise ValueError(text)
        if named_parameters is None:
            if optimizer is None:
                raise ValueError("named_parameters is needed without a torch optimizer")
            named_parameters = [
                (f"param.{i}", p)
                for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])
            ]
        self.wire_dtype = wire
        self.backward_passes_per_step = backward_passes_per_step
        self.gradient_predivide_factor = factor
        self._passes: dict[str, int] = {}  # name -> backward passes since its last send
        super().__init__(optimizer, named_parameters, kvstore, op, **kwargs)

    # -- Horovod's hooks: accumulate n passes, predivide ---------------------------------------
    def _make_hook(self, name: str):
        send = super()._make_hook(name)
        n, factor = self.backward_passes_per_step, self.gradient_predivide_factor
        if n == 1 and factor == 1.0:
            return send

        def hook(p: torch.Tensor) -> None:
            if p.grad is None:
                return
            done = self._passes.get(name, 0) + 1
            if done > n:
                raise RuntimeError(
                    f"parameter {name!r}: more than backward_passes_per_step={n} backward "
                    "passes before step(): raise backward_passes_per_step, or call step() "
                    "(or synchronize()) after every n passes"
                )
            self._passes[name] = done
            if done < n:
                return  # accumulates locally
            if factor != 1.0:
                with torch.no_grad():
                    p.grad.div_(factor)
            send(p)

        return hook

    def synchronize(self) -> None:
        """Wait for every parameter's reduction; ``p.grad`` then holds the reduced gradient
        (call it before ``scaler.unscale_(optimizer)`` under AMP)."""
        n, factor = self.backward_passes_per_step, self.gradient_predivide_factor
        if n > 1 or factor != 1.0:
            # a parameter short of n passes (or whose hook did not run: a gradient set by
            # hand) is sent as it is, as Horovod does
            for name, p in self.named:
                if p.grad is not None and self._passes.get(name, 0) < n:
                    with torch.no_grad():
                        p.grad.div_(factor)
                    super()._make_hook(name)(p)
        self._passes.clear()
        super().synchronize()
        if self.gradient_predivide_factor != 1.0:
            with torch.no_grad():
                for _, p in self.named:
                    if p.grad is not None:
                        p.grad.mul_(self.gradient_predivide_factor)

    # -- what a torch optimizer also has ---------------------------------------------------
    def state_dict(self) -> dict:
        """The wrapped optimizer's state (for a checkpoint)."""
        if self.optimizer is None:
            raise ValueError("no torch optimizer is wrapped (the servers hold the state)")
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Load the wrapped optimizer's state."""
        if self.optimizer is None:
            raise ValueError("no torch optimizer is wrapped (the servers hold the state)")
        self.optimizer.load_state_dict(state)

    @property
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state (GradScaler reads it)."""
        return self.optimizer.state if self.optimizer is not None else {}

    @property
    def defaults(self) -> dict:
        """The wrapped optimizer's defaults."""
        return self.optimizer.defaults if self.optimizer is not None else {}
