"""The next forward pass overlaps the pulls: ``DistributedOptimizer(..., model=model,
overlap_forward=True)`` (``update_on="server"`` or ``"sum"``; README.md says what a user sees).
(docs/MODULES.md, "hetps.torch.overlap")"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from hetps.torch.fusion import FusionGroup
from hetps.torch.launching import refuse_graph_capture

#: why a compiled model is refused
COMPILED = (
    "overlap_forward=True cannot run under torch.compile: its forward pre-hooks wait for the "
    "host (a graph break in every module; fullgraph=True fails) and a compiled graph would "
    "not wait for the new weights. Give the DistributedOptimizer the model before "
    "torch.compile and use overlap_forward=False, or train the model uncompiled"
)


@dataclass(slots=True, eq=False)
class _Pull:
    """A group's pull left in flight by ``step()``."""

    group: FusionGroup
    handle: Any
    have: list[str]  # the members that had a gradient (update_on="sum" updates those)
    error: BaseException | None = None


class ForwardWaits:
    """The pulls ``step()`` left in flight, and the hooks on ``model`` that wait for them.

    ``land(g)`` finishes group ``g`` once its answer is in (e.g. the copy into a parameter the
    KVStore could not land in directly); ``timing.waits`` gets each wait's (start, end)."""

    def __init__(
        self,
        model: torch.nn.Module,
        named: list[tuple[str, torch.nn.Parameter]],
        land: Any,
        timing: Any,
    ) -> None:
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            raise ValueError(COMPILED)
        self._land = land
        self._timing = timing
        self.pending: dict[str, _Pull] = {}  # parameter name -> its group's pull in flight
        names = {id(p): n for n, p in named}
        owned: set[str] = set()
        self._hooks: list[Any] = []
        for module in model.modules():
            own = [names[id(p)] for p in module.parameters(recurse=False) if id(p) in names]
            if not own:
                continue
            owned.update(own)
            self._hooks.append(module.register_forward_pre_hook(self._forward_hook(own)))
            self._hooks.append(module.register_state_dict_pre_hook(self._wait_all_hook))
            self._hooks.append(module.register_load_state_dict_pre_hook(self._wait_all_hook))
        missing = [n for n, _ in named if n not in owned]
        if missing:
            raise ValueError(
                f"overlap_forward=True: parameter(s) {missing[:3]} are not parameters of any "
                "module of model=..., so no forward would wait for their new weights; pass the "
                "model that owns every parameter given, or overlap_forward=False"
            )

    # -- hooks --------------------------------------------------------------------------------
    def _forward_hook(self, own: list[str]):
        def hook(module: torch.nn.Module, args: Any) -> None:
            if torch.compiler.is_compiling():
                raise RuntimeError(COMPILED)
            refuse_graph_capture("overlap_forward's forward pre-hook")
            if self.pending:
                for name in own:
                    pull = self.pending.get(name)
                    if pull is not None:
                        self._wait(pull)

        return hook

    def _wait_all_hook(self, *args: Any, **kwargs: Any) -> None:
        self.wait_all()

    # -- waiting ------------------------------------------------------------------------------
    def launch_all(self, opt: Any) -> None:
        """``step()``: launch what optimizer ``opt`` has still to send and leave every pull in
        flight (each module's forward waits for its own)."""
        t_sync = time.perf_counter()
        opt.tables.push()
        opt.flush_launches()
        exchanged = False
        params = opt.named_params
        for g in opt.groups:
            have = [n for n in g.names if params[n].grad is not None]  # (before zero_grad)
            h = opt.take_handle(g, params)
            if h is not None:
                pull = _Pull(g, h, have)
                for name in g.names:
                    self.pending[name] = pull
                exchanged = True
        opt.after_exchange(t_sync, exchanged)

    def _wait(self, pull: _Pull) -> None:
        if pull.error is not None:
            raise pull.error  # a failed pull stays: its weights are stale
        t0 = time.perf_counter()
        try:
            pull.handle.wait()
            self._land(pull.group, pull.have)
        except BaseException as exc:
            pull.error = exc
            raise
        self._timing.waits.append((t0, time.perf_counter()))
        for name in pull.group.names:
            if self.pending.get(name) is pull:
                del self.pending[name]

    def wait_all(self) -> None:
        """Wait for every pull in flight (first layers first); raise the first failure."""
        seen: set[int] = set()
        for pull in list(self.pending.values()):
            if id(pull) not in seen:
                seen.add(id(pull))
                self._wait(pull)

    def check_unread(self, name: str) -> None:
        """``name`` got a gradient: a pull of it still in flight means a forward read it
        without waiting for its new weight."""
        if name not in self.pending:
            return
        raise RuntimeError(
            f"overlap_forward=True: parameter {name!r} got a gradient, but no forward "
            "pre-hook waited for its new weight: the forward read it outside its own "
            "module's forward (a parent's forward using child.weight, or module.forward() "
            "called instead of module()), so it may have used the previous weight. Call "
            "opt.synchronize() before such a forward, or use overlap_forward=False"
        )

    def close(self) -> None:
        """Wait for what is in flight, then remove the hooks (also if a wait raises)."""
        try:
            self.wait_all()
        finally:
            for h in self._hooks:
                h.remove()
            self._hooks = []
