"""A Lightning strategy over hetps: ``Trainer(strategy=hetps.lightning.PSStrategy(...))``.
(docs/MODULES.md, "hetps.lightning")"""

from __future__ import annotations

import time
from typing import Any

import torch

try:
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.strategies import ParallelStrategy
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError("hetps.lightning needs Lightning: pip install 'hetps[lightning]'") from exc

from hetps import optim as ps_optim
from hetps.optim.sums import SumKeys
from hetps.torch import collectives, process
from hetps.torch.broadcasting import broadcast_parameters
from hetps.torch.sparse import servers_sgd

__all__ = ["PSStrategy"]

MODES = ("sync", "async", "esync")


class PSStrategy(ParallelStrategy):
    """Lightning's strategy for a hetps job: ``mode`` is ``"sync"``, ``"async"`` or
    ``"esync"``; ``server_optimizer`` (async) and ``global_lr`` (esync) as above."""

    strategy_name = "hetps"

    def __init__(
        self,
        mode: str = "sync",
        server_optimizer: ps_optim.Optimizer | None = None,
        global_lr: float = 1.0,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"PSStrategy mode must be one of {', '.join(MODES)}, not {mode!r}")
        if server_optimizer is not None and mode != "async":
            raise ValueError("server_optimizer is the servers' update in mode='async' only")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.mode = mode
        self.server_optimizer = server_optimizer
        self.global_lr = global_lr
        self._dist: dict[int, Any] = {}  # id(torch optimizer) -> its DistributedOptimizer
        self._esync: Any = None
        self._round_open = False
        self._in_rounds = False  # esync: the rounds run (the workers are at different steps)

    # -- the job -----------------------------------------------------------------------------
    @property
    def kv(self) -> Any:
        """This process's store (made on first use: ``dist_async`` in async mode)."""
        if not process.is_initialized() and self.mode == "async":
            process.init(kvstore=process.store_for("dist_async"))
        return process.store_for(None)

    @property
    def is_distributed(self) -> bool:
        """Lightning asks: it then sets a DistributedSampler from the ranks below."""
        return True

    @property
    def global_rank(self) -> int:
        return int(self.kv.rank)

    @property
    def local_rank(self) -> int:
        self.kv  # noqa: B018 - (the store made)
        return process.local_rank()

    @property
    def node_rank(self) -> int:
        cfg = getattr(self.kv, "cfg", None)
        return max(0, int(getattr(cfg, "group_rank", 0))) if cfg is not None else 0

    @property
    def world_size(self) -> int:
        return int(self.kv.num_workers)

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        if devices[0].type == "cpu":
            return torch.device("cpu")
        return devices[self.local_rank % len(devices)]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup_environment(self) -> None:
        """Join the job (the store), and let Lightning's rank-zero helpers know this rank."""
        rank_zero_only.rank = self.global_rank
        super().setup_environment()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup(self, trainer: Any) -> None:
        """Lightning's setup, then the optimizers' distributed part for fitting."""
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        from hetps.torch.optimizer import DistributedOptimizer

        module = self.lightning_module
        assert module is not None
        kv = self.kv
        broadcast_parameters(module.state_dict(), kv, root_rank=0)  # buffers too
        if self.mode == "esync":
            from hetps.esync.trainer import ESyncTrainer

            self._esync = ESyncTrainer(module, kv, global_lr=self.global_lr, prefix="lightning.")
            return
        named = list(module.named_parameters())
        for i, opt in enumerate(self.optimizers):
            raw = opt.optimizer if isinstance(opt, LightningOptimizer) else opt
            mine = {id(p) for g in raw.param_groups for p in g["params"]}
            params = [(n, p) for n, p in named if id(p) in mine]
            if self.mode == "sync":
                dist = DistributedOptimizer(raw, params, kvstore=kv, prefix=f"lightning.{i}.")
            else:
                if len(self.optimizers) != 1:
                    raise ValueError("PSStrategy(mode='async') takes one optimizer")
                # the servers' optimizer, which sums the collectives' keys (reduce)
                server = SumKeys(
                    self.server_optimizer
                    or servers_sgd(
                        raw, "PSStrategy(mode='async') updates on the servers", "server_optimizer"
                    )
                )
                dist = DistributedOptimizer(
                    None, params, kvstore=kv, update_on="server", server_optimizer=server,
                    prefix=f"lightning.{i}.",
                )  # fmt: skip
            self._dist[id(raw)] = dist

    # -- a step ------------------------------------------------------------------------------
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """One step: sync, the workers' mean gradient then the step; async, the gradient to
        the servers and their weights back; esync, a local step (and the round's end)."""
        raw = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        model = model or self.lightning_module
        if self.mode == "esync":
            return self._local_step(raw, closure, model, **kwargs)
        dist = self._dist[id(raw)]
        if self.mode == "async":
            result = closure()  # forward and backward: the hooks push
            dist.step()  # the servers' new weights
            return result

        def synced() -> Any:
            result = closure()  # forward and backward: the hooks push while it runs
            dist.synchronize()  # p.grad is the workers' mean (before Lightning clips it)
            dist.synced = False  # (the wrapped optimizer steps here, not dist.step())
            return result

        return self.precision_plugin.optimizer_step(raw, model=model, closure=synced, **kwargs)

    def _local_step(self, raw: Any, closure: Any, model: Any, **kwargs: Any) -> Any:
        esync = self._esync
        self._in_rounds = True
        if not self._round_open:
            esync.begin_round()
            self._round_open = True
        t0 = time.perf_counter()
        result = self.precision_plugin.optimizer_step(raw, model=model, closure=closure, **kwargs)
        ending = self._ends_after_this_step()
        if esync.step_done(time.perf_counter() - t0) or ending:
            self._round_open = False
            if esync.aggregate(stop=ending):
                self.lightning_module.trainer.should_stop = True
        return result

    def _ends_after_this_step(self) -> bool:
        """Whether this worker's fit ends after the step running now (max_steps, or the last
        batch of the last epoch)."""
        trainer = self.lightning_module.trainer
        if trainer.max_steps not in (None, -1) and trainer.global_step + 1 >= trainer.max_steps:
            return True
        loop = trainer.fit_loop.epoch_loop
        last_batch = loop.batch_progress.current.ready >= trainer.num_training_batches
        max_epochs = trainer.max_epochs
        return bool(last_batch and max_epochs not in (None, -1) and
                    trainer.current_epoch + 1 >= max_epochs)  # fmt: skip

    # -- collectives through the servers ---------------------------------------------------------
    def _lockstep(self, what: str) -> None:
        if self._in_rounds and self.world_size > 1:
            raise ValueError(
                f"PSStrategy(mode='esync'): {what} waits for every worker, and ESync's workers "
                "take different numbers of local steps: log without sync_dist=True (every "
                "worker holds the same averaged model after each round), or use mode='sync'"
            )

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """The mean (``"mean"``/``"avg"``, the default), sum, max or min over the workers."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        self._lockstep("reduce (self.log(..., sync_dist=True))")
        op = str(getattr(reduce_op, "name", reduce_op) or "mean").lower().rsplit(".", 1)[-1]
        if op in ("mean", "avg", "average", "sum"):
            how = collectives.Sum if op == "sum" else collectives.Average
            return collectives.allreduce(tensor, op=how, kvstore=self.kv)
        if op in ("max", "min"):
            every = self.all_gather(tensor)
            return every.amax(0) if op == "max" else every.amin(0)
        raise ValueError(f"reduce_op {reduce_op!r}: use 'mean', 'sum', 'max' or 'min'")

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> Any:
        """Every worker's ``tensor``, stacked along a new first dimension in rank order."""
        self._lockstep("all_gather")
        return collectives.allgather(tensor.detach().unsqueeze(0), kvstore=self.kv)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Worker ``src``'s ``obj`` on every worker."""
        self._lockstep("broadcast")
        return collectives.broadcast_object(obj, root_rank=src, kvstore=self.kv)

    def barrier(self, name: str | None = None) -> None:
        """Wait for every worker (esync, once the rounds run: return at once)."""
        if not self._in_rounds:
            self.kv.barrier()

    def teardown(self) -> None:
        """Remove the optimizers' hooks; Lightning's teardown."""
        for dist in self._dist.values():
            dist.close()
        self._dist = {}
        self._in_rounds = False
        super().teardown()
