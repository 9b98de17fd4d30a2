"""Activation patching: which activations of a clean run restore its behaviour inside a corrupted run.

Two inputs of the same length, clean and corrupted, and a metric m of the logits. Each activation of
the clean forward at a (layer, site), and per position on request, is written into the corrupted
forward (``k3core.modeling.hooks`` write hooks); the table reports

    fraction_restored = (m(patched) - m(corrupted)) / (m(clean) - m(corrupted))

1 where the patch restores the clean metric, 0 where it does nothing. Sites:

- ``resid``: the residual stream entering the layer: its whole depth state (``blocks.i.stream``: h for
  plain / scale-bias runs, every AttnRes source so far otherwise), so patching it at the last layer
  restores the clean metric exactly;
- ``mixer_out``: the KDA / MLA sub-layer output; ``ffn_out``: the FFN / MoE sub-layer output;
- ``depth_weights``: the layer's AttnRes depth weights (both sites), AttnRes runs only.

Trust: a fraction is a ratio to the clean - corrupted gap. When that gap is small (below ``GAP_FLOOR`` of its
metric: 0.05 nats of mean span loss, 0.5 logits of logit difference) the fractions are ratios of noise-sized numbers
(1.36 and -0.50 of a 0.008-nat gap) and ``gap_warning`` says so. Rows of ``resid`` over every position (position -1)
are 1 by construction (after them the corrupted run *is* the clean run): ``by_construction`` marks them; they are
the reference, not a finding. Per position the cost is one forward per (layer, site, position): ``patch_plan``
counts them before anything runs.

Metrics (plain data, ``Metric``): ``logit_diff`` = logit[correct] - logit[wrong] at a position (default
the last); ``span_loss`` = mean next-token loss of the clean tokens [start, stop) (lower is better; the
fraction is still 1 at the clean value).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import pandas as pd
import torch
import torch.nn.functional as F

from k3core.interp.catalogue import hook_points, point_axes
from k3core.modeling.hooks import HookNames, hooks

SITES = ("resid", "mixer_out", "ffn_out", "depth_weights")
#: the clean - corrupted gap below which fractions restored are ratios of noise (units of the metric)
GAP_FLOOR = {"span_loss": 0.05, "logit_diff": 0.5}

Progress = Callable[[int, int, str], None]  # (done, total, what runs next)


class PatchingError(ValueError):
    """Inputs or options that patching cannot use."""


class Stopped(RuntimeError):
    """``should_stop`` asked to stop; ``partial`` holds the rows done so far."""

    def __init__(self, partial: pd.DataFrame):
        super().__init__(f"stopped after {len(partial)} patches")
        self.partial = partial


@dataclass
class Metric:
    """``kind`` "logit_diff" (``correct``, ``wrong`` token ids at ``position``) or "span_loss" (the clean
    tokens at positions [start, stop) as next-token targets)."""

    kind: str = "logit_diff"
    correct: int | None = None
    wrong: int | None = None
    position: int = -1
    start: int | None = None
    stop: int | None = None

    def __post_init__(self) -> None:
        if self.kind == "logit_diff" and (self.correct is None or self.wrong is None):
            raise PatchingError("logit_diff needs the correct and the wrong token ids")
        if self.kind == "span_loss" and (self.start is None or self.stop is None or self.start < 1):
            raise PatchingError("span_loss needs start >= 1 and stop (the positions whose tokens are predicted)")
        if self.kind not in ("logit_diff", "span_loss"):
            raise PatchingError(f"metric kind must be 'logit_diff' or 'span_loss', got {self.kind!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    def __call__(self, logits: torch.Tensor, clean_ids: torch.Tensor) -> float:
        """The metric of one forward's logits [1, T, V]."""
        if self.kind == "logit_diff":
            row = logits[0, self.position].float()
            return float(row[self.correct] - row[self.wrong])
        T = clean_ids.shape[1]
        if not self.start < self.stop <= T:
            raise PatchingError(f"span [{self.start}, {self.stop}) must lie in 1..{T}")
        pred = logits[0, self.start - 1 : self.stop - 1].float()
        return float(F.cross_entropy(pred, clean_ids[0, self.start : self.stop]))


def site_points(config: object, layer: int, site: str) -> list[str]:
    """The hook points one (layer, site) patch writes."""
    if site not in SITES:
        raise PatchingError(f"unknown site {site!r}; sites: {', '.join(SITES)}")
    if site == "resid":
        return [HookNames.block(layer, "stream")]
    if site in ("mixer_out", "ffn_out"):
        return [HookNames.block(layer, site)]
    available = set(hook_points(config))
    return [n for n in (HookNames.block(layer, f"{s}_res.weights") for s in ("attn", "mlp")) if n in available]


def _check_inputs(model: torch.nn.Module, clean: torch.Tensor, corrupted: torch.Tensor) -> None:
    for name, ids in (("clean", clean), ("corrupted", corrupted)):
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
            raise PatchingError(f"{name} input must be token ids [1, T]")
    if clean.shape != corrupted.shape:
        raise PatchingError(
            f"clean and corrupted inputs must have the same length, got {clean.shape[1]} and {corrupted.shape[1]}"
        )


@torch.no_grad()
def record_activations(model: torch.nn.Module, ids: torch.Tensor, points: list[str]) -> dict[str, torch.Tensor]:
    """The values of hook points on one forward (copies), and the logits under the key "logits"."""
    cache: dict[str, torch.Tensor] = {}

    def keep(value: torch.Tensor, name: str, info: dict) -> None:
        cache[name] = value.detach().clone()

    with hooks(read=dict.fromkeys(points, keep)):
        cache["logits"] = model(ids).logits
    return cache


def _replace(clean: torch.Tensor, position: int | None, axis: int) -> Callable:
    def hook(value: torch.Tensor, name: str, info: dict) -> torch.Tensor:
        if position is None:
            return clean.to(value.device, value.dtype)
        out = value.clone()
        index = [slice(None)] * value.dim()
        index[axis] = position
        out[tuple(index)] = clean[tuple(index)].to(value.device, value.dtype)
        return out

    return hook


@torch.no_grad()
def patched_metric(
    model: torch.nn.Module,
    corrupted_ids: torch.Tensor,
    clean_cache: dict[str, torch.Tensor],
    points: list[str],
    metric: Metric,
    clean_ids: torch.Tensor,
    position: int | None = None,
) -> float:
    """The metric of the corrupted forward with ``points`` (all positions, or one) taken from the clean run."""
    write = {}
    for name in points:
        axis = point_axes(name).index("token")
        write[name] = _replace(clean_cache[name], position, axis)
    with hooks(write=write):
        logits = model(corrupted_ids).logits
    return metric(logits, clean_ids)


def gap_warning(clean: float, corrupted: float, kind: str) -> str | None:
    """A sentence when |clean - corrupted| < GAP_FLOOR[kind] (the fractions then mean nothing), else None."""
    gap = clean - corrupted
    floor = GAP_FLOOR[kind]
    if abs(gap) >= floor:
        return None
    return (
        f"The clean - corrupted gap is {gap:+.4g} ({kind}), under {floor:g}: the corruption barely changes the metric, "
        f"so every fraction restored is a ratio of noise-sized numbers. Corrupt an earlier or more telling token, or "
        f"measure a metric the corruption moves."
    )


def patch_plan(
    config: object,
    tokens: int,
    sites: tuple[str, ...] | list[str] = SITES,
    layers: list[int] | None = None,
    per_position: bool = False,
    positions: tuple[int, int] | None = None,
) -> list[tuple[int, str, list[str], int | None]]:
    """(layer, site, hook points, position or None) of every patched forward, in run order: one per (layer, site
    that exists there) and, per position, per position of ``positions`` [start, stop) (default all ``tokens``).
    Its length is the job's cost in forwards (plus the clean and the corrupted run)."""
    layers = list(range(config.num_hidden_layers)) if layers is None else layers
    start, stop = (0, tokens) if positions is None else positions
    if not 0 <= start < stop <= tokens:
        raise PatchingError(f"positions must be a window [start, stop) inside 0..{tokens}, got [{start}, {stop})")
    plan = []
    for layer in layers:
        for site in sites:
            points = site_points(config, layer, site)
            if points:
                where = range(start, stop) if per_position else [None]
                plan += [(layer, site, points, p) for p in where]
    return plan


def activation_patching(
    model: torch.nn.Module,
    clean_ids: torch.Tensor,
    corrupted_ids: torch.Tensor,
    metric: Metric,
    sites: tuple[str, ...] | list[str] = SITES,
    layers: list[int] | None = None,
    per_position: bool = False,
    progress: Progress | None = None,
    should_stop: Callable[[], bool] | None = None,
    positions: tuple[int, int] | None = None,
) -> pd.DataFrame:
    """Fraction of the metric restored by patching each (layer, site) [and position] from clean into corrupted.

    Columns: layer, site, position (-1: every position), metric, fraction_restored, by_construction; ``df.attrs``
    holds the clean and corrupted metric values and ``gap_warning``'s sentence (None when the gap is large enough).
    ``depth_weights`` is skipped on runs without AttnRes; per position, ``positions`` [start, stop) limits the
    window (``patch_plan``)."""
    _check_inputs(model, clean_ids, corrupted_ids)
    plan = patch_plan(model.config, clean_ids.shape[1], sites, layers, per_position, positions)
    was_training = model.training
    model.eval()
    try:
        needed = sorted({p for _, _, points, _ in plan for p in points})
        cache = record_activations(model, clean_ids, needed)
        clean = metric(cache["logits"], clean_ids)
        with torch.no_grad():
            corrupt = metric(model(corrupted_ids).logits, clean_ids)
        span = clean - corrupt
        if span == 0:
            raise PatchingError(
                f"the clean and the corrupted input give the same metric ({clean:.6g}): nothing to restore "
                "(does the corruption come before the position the metric reads?)"
            )
        rows = []
        for k, (layer, site, points, position) in enumerate(plan):
            if should_stop is not None and should_stop():
                raise Stopped(_frame(rows, clean, corrupt, metric.kind))
            if progress:
                where = "" if position is None else f" position {position}"
                progress(k, len(plan), f"layer {layer} {site}{where}")
            value = patched_metric(model, corrupted_ids, cache, points, metric, clean_ids, position)
            rows.append(
                dict(
                    layer=layer,
                    site=site,
                    position=-1 if position is None else position,
                    metric=value,
                    fraction_restored=(value - corrupt) / span,
                    by_construction=site == "resid" and position is None,
                )
            )
        if progress:
            progress(len(plan), len(plan), "done")
    finally:
        model.train(was_training)
    return _frame(rows, clean, corrupt, metric.kind)


def _frame(rows: list[dict], clean: float, corrupt: float, kind: str) -> pd.DataFrame:
    columns = ["layer", "site", "position", "metric", "fraction_restored", "by_construction"]
    df = pd.DataFrame(rows, columns=columns)
    df.attrs.update(clean_metric=clean, corrupted_metric=corrupt, gap_warning=gap_warning(clean, corrupt, kind))
    return df
