"""Training history from a run's ``metrics.json``: a tolerant reader that turns it into tidy tables.

The native layout is the one ``k3core.training`` writes (``format`` "k3lab-metrics", version 1)::

    {"status": ..., "step": 120, "params": {...}, "data": {"unigram_baseline_bpb": ...},
     "history": {"train":   [{"step", "tokens", "lr", "loss", "bpb", "grad_norm", ...}],
                 "val":     [{"step", "tokens", "val_loss", "val_bpb", "mqar_accuracy"}],
                 "moe":     [{"step", "layers": {"<layer>": {"load": [...], "max_vio", "cv", "bias": [...]}}}],
                 "attnres": [{"step", "mode", "sites": {"<site>": {"query_norm", "mean_weights", "sources"}}}
                             or {"step", "mode": "scale_bias", "layers": {"<layer>": {"attn_scale_mean", ...}}}]},
     "final": {"step", "tokens_seen", "val_loss", "val_bpb", "mqar_accuracy", ...} or null}

Other layouts also work (anything else, or a missing key, gives an empty table and the views say
NotApplicable):

- a list of step records, under ``history`` / ``steps`` / ``log`` / ``train`` / ``records`` /
  ``train_log`` or as the whole file, plus optional eval records under ``eval`` / ``evals`` / ``val`` /
  ``validation`` / ``eval_history`` (merged on step);
- columns instead of records (``{"step": [...], "loss": [...]}``);
- nested dicts flatten to dotted names (``/`` counts as a dot); a list of numbers is one value per index;
  a dict keyed by layer numbers puts the layer in the ``index`` column.

Metric names are matched by alias on their last dotted component(s): train loss (``loss``,
``train_loss``, ``lm_loss``), train bits per byte (``train.bpb``, ``train_bpb``), validation bits per
byte (``val_bpb``, ``val_bits_per_byte``), validation loss, MQAR accuracy (``mqar_accuracy``,
``mqar_acc``, ``mqar``), tokens seen (``tokens``, ``tokens_seen``), MoE MaxVio / CV (last component
``max_vio``/``maxvio`` / ``cv``) and AttnRes summaries (names starting with ``attnres``).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
import pandas as pd

from analysis.metrics.entropy import normalised_entropy

RECORD_KEYS = ("history", "steps", "log", "train", "records", "train_log")
EVAL_KEYS = ("eval", "evals", "val", "validation", "eval_history")
ALIASES = {
    "loss": ("train.loss", "loss", "train_loss", "lm_loss"),
    "train_bpb": ("train.bpb", "train_bpb", "train.bits_per_byte"),
    "val_bpb": ("val_bpb", "val_bits_per_byte", "val.bpb", "val.bits_per_byte"),
    "val_loss": ("val_loss", "val.loss", "eval_loss"),
    "mqar_acc": ("mqar_accuracy", "mqar_acc", "mqar", "val.mqar_acc", "val.mqar"),
    "tokens": ("tokens", "tokens_seen", "seen_tokens", "num_tokens"),
    "lr": ("lr", "learning_rate"),
}
LONG_COLUMNS = ["step", "metric", "index", "value"]
CURVES = (  # (alias kind, curve label, panel)
    ("loss", "train loss", "train loss"),
    ("train_bpb", "train bits/byte", "bits per byte"),
    ("val_bpb", "val bits/byte", "bits per byte"),
    ("val_loss", "val loss", "val loss"),
    ("mqar_acc", "MQAR accuracy", "MQAR accuracy"),
)


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real)


def _is_index(key: Any) -> bool:
    return str(key).lstrip("-").isdigit()


def _flatten(obj: Any, prefix: str, out: list[tuple[str, int | None, float]], index: int | None = None) -> None:
    """(name, index, value) triples from nested dicts/lists of numbers; dicts keyed by layer numbers give the
    index (lists below an index are skipped: one index per value)."""
    if _is_number(obj):
        if prefix:
            out.append((prefix, index, float(obj)))
        return
    if isinstance(obj, dict):
        if index is None and obj and all(_is_index(k) for k in obj):
            if all(_is_number(v) for v in obj.values()):
                out.extend((prefix, int(k), float(v)) for k, v in obj.items())
                return
            if all(isinstance(v, dict) for v in obj.values()):
                for k, v in obj.items():
                    _flatten(v, prefix, out, index=int(k))
                return
        for key, value in obj.items():
            name = str(key).replace("/", ".")
            _flatten(value, f"{prefix}.{name}" if prefix else name, out, index)
        return
    if index is None and isinstance(obj, (list, tuple)) and obj and all(_is_number(v) or v is None for v in obj):
        out.extend((prefix, i, float("nan") if v is None else float(v)) for i, v in enumerate(obj))


def _columns_to_records(cols: dict) -> list[dict] | None:
    lengths = {len(v) for v in cols.values() if isinstance(v, list)}
    if "step" not in cols or not isinstance(cols["step"], list) or len(lengths) != 1:
        return None
    n = lengths.pop()
    return [{k: v[i] for k, v in cols.items() if isinstance(v, list) and len(v) == n} for i in range(n)]


def _streams(metrics: Any) -> list[tuple[str, list[dict]]]:
    """(prefix, records) streams: the native history.{train,val,moe,attnres} lists, else the generic layouts."""
    if isinstance(metrics, list):
        return [("", [r for r in metrics if isinstance(r, dict)])]
    if not isinstance(metrics, dict):
        return []
    hist = metrics.get("history")
    if isinstance(hist, dict) and _columns_to_records(hist) is None:
        streams = [(str(k), [r for r in v if isinstance(r, dict)]) for k, v in hist.items() if isinstance(v, list)]
        if streams:
            return streams
    out = []
    for keys in (RECORD_KEYS, EVAL_KEYS):
        for key in keys:
            value = metrics.get(key)
            if isinstance(value, list):
                out.append(("", [r for r in value if isinstance(r, dict)]))
                break
            if isinstance(value, dict):
                recs = _columns_to_records(value)
                if recs is not None:
                    out.append(("", recs))
                    break
        else:
            if keys is RECORD_KEYS:
                recs = _columns_to_records(metrics)
                if recs:
                    out.append(("", recs))
    return out


def history_long(metrics: dict | list | None) -> pd.DataFrame:
    """Every logged number as tidy rows: step, metric (dotted name), index (layer/site or NaN), value.

    Native records are prefixed by their stream (``train.loss``, ``val.val_bpb``, ``moe.layers.max_vio``);
    records without a ``step`` get their position in the list."""
    rows = []
    for prefix, records in _streams(metrics) if metrics else []:
        for n, rec in enumerate(records):
            step = rec.get("step", rec.get("iter", rec.get("iteration", n)))
            if not _is_number(step):
                continue
            triples: list[tuple[str, int | None, float]] = []
            body = {k: v for k, v in rec.items() if k not in ("step", "iter", "iteration")}
            _flatten(body, prefix, triples)
            rows += [(int(step), name, idx, value) for name, idx, value in triples]
    df = pd.DataFrame(rows, columns=LONG_COLUMNS)
    df["index"] = df["index"].astype("float64")
    return df.sort_values(["metric", "step", "index"], kind="stable").reset_index(drop=True)


def _matches(name: str, aliases: tuple[str, ...]) -> bool:
    name = name.lower()
    return any(name == a or name.endswith("." + a) for a in aliases)


def find_metric(long: pd.DataFrame, kind: str) -> str | None:
    """The metric name in ``long`` best matching the aliases of ``kind`` (see ALIASES), or None."""
    aliases = ALIASES[kind]
    names = [m for m in dict.fromkeys(long["metric"]) if _matches(m, aliases)]
    if not names:
        return None
    names.sort(key=lambda m: min(i for i, a in enumerate(aliases) if _matches(m, (a,))))
    return names[0]


def scalar_series(long: pd.DataFrame, kind: str) -> pd.DataFrame:
    """One metric (by alias kind) over steps, mean over indices. Columns: step, value (empty if absent)."""
    name = find_metric(long, kind)
    if name is None:
        return pd.DataFrame(columns=["step", "value"])
    part = long[long["metric"] == name]
    return part.groupby("step", as_index=False)["value"].mean().dropna()


def tokens_by_step(long: pd.DataFrame) -> pd.Series | None:
    """Tokens seen at each logged step (every metric named like ``tokens``, first value per step)."""
    names = [m for m in dict.fromkeys(long["metric"]) if _matches(m, ALIASES["tokens"])]
    if not names:
        return None
    part = long[long["metric"].isin(names)]
    return part.groupby("step")["value"].first()


def curves_table(metrics: dict | None, run: str = "run") -> pd.DataFrame:
    """Loss curves: run, step, tokens (NaN if not logged), curve, panel, value. Curves: train loss, train and
    val bits/byte (one panel), val loss, MQAR accuracy."""
    long = history_long(metrics)
    tokens = tokens_by_step(long)
    frames = []
    for kind, label, panel in CURVES:
        s = scalar_series(long, kind)
        if not s.empty:
            frames.append(s.assign(curve=label, panel=panel))
    if not frames:
        return pd.DataFrame(columns=["run", "step", "tokens", "curve", "panel", "value"])
    df = pd.concat(frames, ignore_index=True)
    df["tokens"] = df["step"].map(tokens) if tokens is not None else float("nan")
    df.insert(0, "run", run)
    df = df[["run", "step", "tokens", "curve", "panel", "value"]]
    df.attrs.update(keys=["run", "curve", "step"], value="value")
    return df


def moe_balance_table(metrics: dict | None, run: str = "run") -> pd.DataFrame:
    """MoE load statistics over steps: run, step, stat ('MaxVio' or 'CV'), metric, index (MoE layer), value."""
    long = history_long(metrics)
    tail = long["metric"].str.lower().str.split(".").str[-1].str.replace("_", "", regex=False)
    frames = []
    for stat, names in (("MaxVio", ("maxvio",)), ("CV", ("cv", "loadcv", "moecv"))):
        part = long[tail.isin(names)]
        if not part.empty:
            frames.append(part.assign(stat=stat))
    if not frames:
        return pd.DataFrame(columns=["run", "step", "stat", "metric", "index", "value"])
    df = pd.concat(frames, ignore_index=True)
    df.insert(0, "run", run)
    return df[["run", "step", "stat", "metric", "index", "value"]]


def _mix_summary(weights: list, sources: list) -> dict[str, float]:
    """Embedding weight, max weight and normalised entropy of one site's mean depth mix."""
    p = np.asarray([np.nan if w is None else w for w in weights], dtype=np.float64)
    if p.size == 0 or not np.isfinite(p).all():
        return {}
    idx = list(sources).index("embedding") if "embedding" in (sources or []) else 0
    ent = float(normalised_entropy(p))  # one source: 0, as every depth-mix entropy (analysis.metrics.entropy)
    return {"embedding_weight": float(p[idx]), "max_weight": float(p.max()), "mix_entropy": ent}


def attnres_history_table(metrics: dict | None, run: str = "run") -> pd.DataFrame:
    """AttnRes over training: run, step, site, metric, value.

    Native records give per site ``query_norm``, ``embedding_weight`` (mean depth weight on the embedding),
    ``max_weight`` and ``mix_entropy`` (entropy of the mean mix / log n_sources); scale/bias records give the
    per-layer scale and bias means. Other layouts: every metric named ``attnres*`` (site = its index)."""
    rows = []
    hist = metrics.get("history") if isinstance(metrics, dict) else None
    native = hist.get("attnres") if isinstance(hist, dict) else None
    if isinstance(native, list):
        for rec in native:
            if not isinstance(rec, dict) or not _is_number(rec.get("step")):
                continue
            step = int(rec["step"])
            for site, info in (rec.get("sites") or {}).items():
                if not isinstance(info, dict):
                    continue
                values = _mix_summary(info.get("mean_weights") or [], info.get("sources") or [])
                if _is_number(info.get("query_norm")):
                    values["query_norm"] = float(info["query_norm"])
                rows += [(run, step, str(site), k, v) for k, v in values.items()]
            for layer, info in (rec.get("layers") or {}).items():
                if isinstance(info, dict):
                    rows += [(run, step, f"L{layer}", k, float(v)) for k, v in info.items() if _is_number(v)]
    else:
        long = history_long(metrics)
        part = long[long["metric"].str.lower().str.startswith("attnres")]
        rows = [
            (run, int(r.step), "" if math.isnan(r.index) else str(int(r.index)), r.metric, r.value)
            for r in part.itertuples()
        ]
    return pd.DataFrame(rows, columns=["run", "step", "site", "metric", "value"])


def final_numbers(metrics: dict | None) -> dict[str, float]:
    """Headline training numbers: the native ``final`` block's numbers, the unigram baseline, and from the history
    the last train loss, last and best val bits/byte (and loss), last MQAR accuracy, tokens seen and last step."""
    out: dict[str, float] = {}
    if not metrics:
        return out
    if isinstance(metrics, dict):
        final = metrics.get("final") if isinstance(metrics.get("final"), dict) else {}
        data = metrics.get("data") if isinstance(metrics.get("data"), dict) else {}
        sources = [final, {k: data[k] for k in ("unigram_baseline_bpb",) if k in data}]
        sources.append({k: metrics[k] for k in ("tokens_seen", "val_bpb", "val_loss") if k in metrics})
        for source in sources:
            for key, value in source.items():
                if _is_number(value) and math.isfinite(float(value)):
                    out[str(key)] = float(value)
    long = history_long(metrics)
    if long.empty:
        return out
    out["last_step"] = float(long["step"].max())
    for kind in ("loss", "val_bpb", "val_loss", "mqar_acc"):
        s = scalar_series(long, kind)
        if not s.empty:
            out[f"final_{kind}"] = float(s["value"].iloc[-1])
            if kind in ("val_bpb", "val_loss"):
                out[f"best_{kind}"] = float(s["value"].min())
    tokens = tokens_by_step(long)
    if tokens is not None and len(tokens):
        out.setdefault("tokens_seen", float(tokens.max()))
    return out
