"""Training history from a run's ``metrics.json``: a tolerant reader that turns it into tidy tables.

Accepted layouts (anything else, or a missing key, simply gives an empty table; the views then say
NotApplicable):

    {"history": [ {"step": 100, "tokens": 409600, "loss": 2.31, "lr": 3e-3,
                   "val_bpb": 2.40, "mqar_acc": 0.12,
                   "moe": {"maxvio": [0.8, 1.1], "cv": [0.3, 0.4]},        # one value per MoE layer
                   "attnres": {"embedding_weight": [...], "entropy": [...]}}, ...],
     "eval": [ {"step": 500, "val_bpb": 2.2, "mqar_acc": 0.3}, ... ],          # optional, merged on step
     "final": {"val_bpb": 2.1, ...}, "tokens_seen": 1234567, ...}              # optional scalars

- the record list may also be called ``steps``, ``log``, ``train``, ``records`` or ``train_log``; the
  eval list ``evals``, ``val``, ``validation`` or ``eval_history``; the whole file may be that list;
- columns instead of records (``{"step": [...], "loss": [...]}``, at the top or under one of those keys)
  work too;
- nested dicts flatten to dotted names (``moe.maxvio``; ``/`` counts as a dot: ``train/loss``); a list of
  numbers is one value per index (layer or site); a dict keyed by layer numbers likewise.

Metric names are matched by alias on the last dotted component(s): train loss (``loss``,
``train_loss``, ``lm_loss``), validation bits per byte (``val_bpb``, ``val_bits_per_byte``, ``bpb``),
MQAR accuracy (``mqar_acc``, ``mqar_accuracy``, ``mqar``), tokens seen (``tokens``, ``tokens_seen``),
MoE MaxVio / CV (any name containing ``maxvio`` / ending in ``cv``) and AttnRes summaries (any name
starting with ``attnres``).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import pandas as pd

RECORD_KEYS = ("history", "steps", "log", "train", "records", "train_log")
EVAL_KEYS = ("eval", "evals", "val", "validation", "eval_history")
ALIASES = {
    "loss": ("loss", "train_loss", "train.loss", "lm_loss"),
    "val_bpb": ("val_bpb", "val_bits_per_byte", "val.bpb", "val.bits_per_byte", "bpb", "bits_per_byte"),
    "val_loss": ("val_loss", "val.loss", "eval_loss"),
    "mqar_acc": ("mqar_acc", "mqar_accuracy", "mqar", "val.mqar_acc", "val.mqar"),
    "tokens": ("tokens", "tokens_seen", "seen_tokens", "num_tokens"),
    "lr": ("lr", "learning_rate"),
}
LONG_COLUMNS = ["step", "metric", "index", "value"]


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real)


def _flatten(obj: Any, prefix: str, out: list[tuple[str, int | None, float]]) -> None:
    """(name, index, value) triples from nested dicts/lists of numbers."""
    if isinstance(obj, numbers.Real):
        value = float(obj)
        if prefix:
            out.append((prefix, None, value))
        return
    if isinstance(obj, dict):
        if obj and all(str(k).lstrip("-").isdigit() for k in obj) and all(_is_number(v) for v in obj.values()):
            out.extend((prefix, int(k), float(v)) for k, v in obj.items())
            return
        for key, value in obj.items():
            name = str(key).replace("/", ".")
            _flatten(value, f"{prefix}.{name}" if prefix else name, out)
        return
    if isinstance(obj, (list, tuple)) and obj and all(_is_number(v) or v is None for v in obj):
        out.extend((prefix, i, float("nan") if v is None else float(v)) for i, v in enumerate(obj))


def _columns_to_records(cols: dict) -> list[dict] | None:
    lengths = {len(v) for v in cols.values() if isinstance(v, list)}
    if "step" not in cols or not isinstance(cols["step"], list) or len(lengths) != 1:
        return None
    n = lengths.pop()
    return [{k: v[i] for k, v in cols.items() if isinstance(v, list) and len(v) == n} for i in range(n)]


def _find_records(metrics: Any, keys: tuple[str, ...]) -> list[dict]:
    if isinstance(metrics, list):
        return [r for r in metrics if isinstance(r, dict)] if keys is RECORD_KEYS else []
    if not isinstance(metrics, dict):
        return []
    for key in keys:
        value = metrics.get(key)
        if isinstance(value, list):
            return [r for r in value if isinstance(r, dict)]
        if isinstance(value, dict):
            recs = _columns_to_records(value)
            if recs is not None:
                return recs
    if keys is RECORD_KEYS:
        return _columns_to_records(metrics) or []
    return []


def history_long(metrics: dict | list | None) -> pd.DataFrame:
    """Every logged number as tidy rows: step, metric (dotted name), index (layer/site or NaN), value.

    Records without a ``step`` get their position in the list. Eval records are merged on their step.
    """
    if not metrics:
        return pd.DataFrame(columns=LONG_COLUMNS)
    rows = []
    for keys in (RECORD_KEYS, EVAL_KEYS):
        for n, rec in enumerate(_find_records(metrics, keys)):
            step = rec.get("step", rec.get("iter", rec.get("iteration", n)))
            if not _is_number(step):
                continue
            triples: list[tuple[str, int | None, float]] = []
            _flatten({k: v for k, v in rec.items() if k not in ("step", "iter", "iteration")}, "", triples)
            rows += [(int(step), name, idx, value) for name, idx, value in triples]
    df = pd.DataFrame(rows, columns=LONG_COLUMNS)
    df["index"] = df["index"].astype("float64")
    return df.sort_values(["metric", "step", "index"], kind="stable").reset_index(drop=True)


def _matches(name: str, aliases: tuple[str, ...]) -> bool:
    name = name.lower()
    return any(name == a or name.endswith("." + a) for a in aliases)


def find_metric(long: pd.DataFrame, kind: str) -> str | None:
    """The first metric name in ``long`` matching the aliases of ``kind`` (see ALIASES), or None."""
    aliases = ALIASES[kind]
    names = [m for m in dict.fromkeys(long["metric"]) if _matches(m, aliases)]
    if not names:
        return None
    names.sort(key=lambda m: min(aliases.index(a) for a in aliases if _matches(m, (a,))))
    return names[0]


def scalar_series(long: pd.DataFrame, kind: str) -> pd.DataFrame:
    """One metric (by alias kind) over steps, mean over indices. Columns: step, value (empty if absent)."""
    name = find_metric(long, kind)
    if name is None:
        return pd.DataFrame(columns=["step", "value"])
    part = long[long["metric"] == name]
    return part.groupby("step", as_index=False)["value"].mean().dropna()


def tokens_by_step(long: pd.DataFrame) -> pd.Series | None:
    """Tokens seen at each logged step, when the history logs it."""
    series = scalar_series(long, "tokens")
    return None if series.empty else series.set_index("step")["value"]


def curves_table(metrics: dict | None, run: str = "run") -> pd.DataFrame:
    """Loss curves: run, step, tokens (NaN if not logged), curve ('train loss', 'val bits/byte',
    'val loss', 'MQAR accuracy'), value."""
    long = history_long(metrics)
    tokens = tokens_by_step(long)
    frames = []
    for kind, label in (
        ("loss", "train loss"),
        ("val_bpb", "val bits/byte"),
        ("val_loss", "val loss"),
        ("mqar_acc", "MQAR accuracy"),
    ):
        s = scalar_series(long, kind)
        if s.empty:
            continue
        frames.append(s.assign(curve=label))
    if not frames:
        return pd.DataFrame(columns=["run", "step", "tokens", "curve", "value"])
    df = pd.concat(frames, ignore_index=True)
    df["tokens"] = df["step"].map(tokens) if tokens is not None else float("nan")
    df.insert(0, "run", run)
    return df[["run", "step", "tokens", "curve", "value"]]


def moe_balance_table(metrics: dict | None, run: str = "run") -> pd.DataFrame:
    """MoE load statistics over steps: run, step, stat ('MaxVio' or 'CV'), index (MoE layer), value."""
    long = history_long(metrics)
    frames = []
    for stat, test in (
        ("MaxVio", lambda m: "maxvio" in m.lower()),
        ("CV", lambda m: m.lower().split(".")[-1] in ("cv", "load_cv", "moe_cv")),
    ):
        part = long[long["metric"].map(test)]
        if not part.empty:
            frames.append(part.assign(stat=stat))
    if not frames:
        return pd.DataFrame(columns=["run", "step", "stat", "metric", "index", "value"])
    df = pd.concat(frames, ignore_index=True)
    df.insert(0, "run", run)
    return df[["run", "step", "stat", "metric", "index", "value"]]


def attnres_history_table(metrics: dict | None, run: str = "run") -> pd.DataFrame:
    """AttnRes summaries over steps (any metric named attnres*): run, step, metric, index, value."""
    long = history_long(metrics)
    part = long[long["metric"].str.lower().str.startswith("attnres")]
    df = part.assign(run=run)
    return df[["run", "step", "metric", "index", "value"]].reset_index(drop=True)


def final_numbers(metrics: dict | None) -> dict[str, float]:
    """Headline training numbers: last train loss, last and best val bits/byte, last MQAR accuracy, tokens seen,
    last step, plus numeric scalars at the top level and under ``final`` (absent ones are left out)."""
    out: dict[str, float] = {}
    if not metrics:
        return out
    if isinstance(metrics, dict):
        for source in (metrics, metrics.get("final") if isinstance(metrics.get("final"), dict) else {}):
            for key, value in source.items():
                if _is_number(value) and math.isfinite(float(value)):
                    out[str(key)] = float(value)
    long = history_long(metrics)
    if long.empty:
        return out
    out["last_step"] = float(long["step"].max())
    for kind in ("loss", "val_bpb", "val_loss", "mqar_acc", "tokens"):
        s = scalar_series(long, kind)
        if not s.empty:
            out[f"final_{kind}" if kind != "tokens" else "tokens_seen"] = float(s["value"].iloc[-1])
            if kind in ("val_bpb", "val_loss"):
                out[f"best_{kind}"] = float(s["value"].min())
    return out
