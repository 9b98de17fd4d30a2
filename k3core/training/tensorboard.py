"""TensorBoard event files of a training run, beside its metrics.json (which stays the app's format).

:class:`TensorBoardLog` turns the history entries the loop appends (``k3core.training.history``) into scalars,
one tag per quantity, with the optimizer step as the x axis::

    train/loss, train/bits_per_byte, train/lr, train/grad_norm, train/tokens_per_s, train/step_time_s
    train/aux_loss                        (balancing = "aux_loss")
    val/loss, val/bits_per_byte, val/mqar_accuracy
    moe/layer_<i>/max_vio                 (MaxVio of the load since the last entry, load_stats.moe_load_stats)
    moe/layer_<i>/dead_share              (share of experts that got no token since the last entry)
    attnres/<site>/<source>               (mean depth weight of each source, on a validation batch)

``tensorboard --logdir <run dir>`` reads them. The ``tensorboard`` package is an optional extra
(``pip install k3lab[tensorboard]``); without it nothing is written.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any


def tensorboard_available() -> bool:
    """Whether the ``tensorboard`` package (which torch's SummaryWriter writes with) is installed."""
    return importlib.util.find_spec("tensorboard") is not None


def dead_share(load: list[float]) -> float:
    """Share of experts with no assignment: #{e : c_e = 0} / E (NaN for no experts)."""
    return sum(1 for c in load if c == 0) / len(load) if load else math.nan


class TensorBoardLog:
    """Scalars of one run in ``run_dir`` (a no-op without the tensorboard package).

    ``purge_step``: on resume, the first step this session logs (the checkpoint's step + 1); TensorBoard hides the
    events a previous session wrote at that step and after (steps that are being trained again)."""

    def __init__(self, run_dir: Path, purge_step: int | None = None) -> None:
        self.writer = None
        if tensorboard_available():
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir), purge_step=purge_step)

    def _add(self, tag: str, value: float | None, step: int) -> None:
        if self.writer is not None and value is not None:
            self.writer.add_scalar(tag, float(value), step)

    def train(self, entry: dict[str, Any], step_seconds: float) -> None:
        """A history.train entry and the mean wall time of its steps."""
        step = entry["step"]
        for key, tag in (("loss", "loss"), ("bpb", "bits_per_byte"), ("lr", "lr"), ("grad_norm", "grad_norm"),
                         ("tokens_per_s", "tokens_per_s"), ("aux_loss", "aux_loss")):  # fmt: skip
            self._add(f"train/{tag}", entry.get(key), step)
        self._add("train/step_time_s", step_seconds, step)

    def val(self, entry: dict[str, Any]) -> None:
        """A history.val entry."""
        for key, tag in (("val_loss", "loss"), ("val_bpb", "bits_per_byte"), ("mqar_accuracy", "mqar_accuracy")):
            self._add(f"val/{tag}", entry.get(key), entry["step"])
        self.flush()

    def moe(self, entry: dict[str, Any]) -> None:
        """A history.moe entry: each MoE layer's MaxVio and dead-expert share."""
        for layer, stats in entry["layers"].items():
            self._add(f"moe/layer_{layer}/max_vio", stats["max_vio"], entry["step"])
            self._add(f"moe/layer_{layer}/dead_share", dead_share(stats["load"]), entry["step"])

    def attnres(self, entry: dict[str, Any]) -> None:
        """A history.attnres entry: each site's mean depth weight per source (Block / Full AttnRes)."""
        for site, info in entry.get("sites", {}).items():
            for source, weight in zip(info["sources"], info["mean_weights"]):
                self._add(f"attnres/{site}/{source}", weight, entry["step"])

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
