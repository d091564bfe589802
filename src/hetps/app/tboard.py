"""``hetps train --tensorboard DIR``: the training curves as TensorBoard scalars, live.
(docs/MODULES.md, "hetps.app.tboard")"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["PHASE_TAGS", "TensorBoardLog", "scalars_of"]

#: record key -> TensorBoard tag, for the phase times
PHASE_TAGS = {key: f"time/{key}" for key in ("compute_s", "push_s", "wait_s", "pull_s")}


def scalars_of(rec: dict[str, Any]) -> dict[str, float]:
    """The TensorBoard scalars of one round's log record: ``{tag: value}``."""
    out: dict[str, float] = {}
    if rec.get("loss") is not None:
        out["train/loss"] = float(rec["loss"])
    if rec.get("accuracy") is not None:
        out["eval/accuracy"] = float(rec["accuracy"])
    round_s = rec.get("srit_s")
    if isinstance(round_s, (int, float)) and round_s > 0:
        out["speed/samples_per_s"] = float(rec["samples"]) / float(round_s)
        out["time/round_s"] = float(round_s)
        out["time/step_s"] = float(round_s) / max(1, int(rec.get("local_steps") or 1))
    for key, tag in PHASE_TAGS.items():
        if isinstance(rec.get(key), (int, float)):
            out[tag] = float(rec[key])
    return out


class TensorBoardLog:
    """One worker's TensorBoard run under ``DIR/<run_name>/worker<rank>``."""

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        run_name: str,
        rank: int,
        run_start: float,
        flush_secs: int = 10,
    ) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch's writer needs the tensorboard package
            raise SystemExit(
                "hetps train: --tensorboard needs the tensorboard package; fix: "
                "pip install 'hetps[tensorboard]' (or drop --tensorboard)"
            ) from e
        self.dir = Path(log_dir) / run_name / f"worker{rank}"
        self.run_start = float(run_start)
        self._writer = SummaryWriter(log_dir=str(self.dir), flush_secs=flush_secs)

    def write(self, rec: dict[str, Any]) -> None:
        """Add the scalars of one round (its log record)."""
        step = int(rec["iter"])
        wall = self.run_start + float(rec["t"])
        for tag, value in scalars_of(rec).items():
            self._writer.add_scalar(tag, value, global_step=step, walltime=wall)

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()
