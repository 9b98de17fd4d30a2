"""A run's headline numbers on one trace, and two runs' numbers side by side with their delta.

Every number here is a summary of a metric defined once elsewhere: MoE balance in ``analysis.metrics.moe``
(MaxVio and CV from ``k3core.training.load_stats``), the KDA memory half-life in ``analysis.metrics.kda_memory``,
attention metrics in ``analysis.metrics.attention``, hidden-state metrics in ``analysis.metrics.hidden_states``, AttnRes
weights in ``analysis.metrics.attnres``, training numbers in ``analysis.metrics.history``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.metrics import attention as at
from analysis.metrics import attnres as ar
from analysis.metrics import hidden_states as hs
from analysis.metrics import kda_memory as km
from analysis.metrics import moe as mo
from analysis.metrics.history import final_numbers
from analysis.metrics.loss_noise import LossNoise, headline_noise, noise_statement
from analysis.runs.context import AnalysisContext
from analysis.runs.missing_data import MissingTraceData
from k3core.interp.trace import Trace, names

HEADLINE_LABELS = {
    "loss": "loss (nats/token)",
    "bits_per_token": "bits/token",
    "bits_per_byte": "bits/byte",
    "mla_entropy_norm_mean": "MLA entropy (normalised, mean)",
    "sink_rate": "sink rate",
    "rank_collapse_mean": "rank-collapse ratio (mean over depth)",
    "token_cosine_mean": "token cosine (mean)",
    "block_influence_mean": "Block Influence (mean)",
    "massive_ratio_max": "max/median |h| (worst depth)",
    "moe_maxvio_max": "MoE MaxVio (max over layers)",
    "moe_maxvio_floor": "MoE MaxVio of balanced routing (97.5%)",
    "moe_entropy_norm_mean": "MoE load entropy (normalised)",
    "moe_cv_mean": "MoE load CV (mean)",
    "moe_dead_experts": "MoE dead experts",
    "attnres_embedding_weight_mean": "AttnRes embedding weight (mean)",
    "kda_half_life_mean": "KDA half-life, mean of finite (tokens)",
    "kda_half_life_median": "KDA half-life, median (tokens)",
    "kda_half_life_inf_share": "KDA channels with alpha = 1",
    "mla_gate_mean": "MLA output gate (mean)",
    "train_final_val_bpb": "val bits/byte (training)",
    "tokens": "tokens traced",
}

_NAN = float("nan")
DIAGNOSTICS_DOC = Path(__file__).resolve().parents[2] / "docs" / "DIAGNOSTICS.md"
_HELP_LINE = re.compile(r"^- `([a-z0-9_]+)`: (.+)$")


def headline_help(doc: Path = DIAGNOSTICS_DOC) -> dict[str, str]:
    """The one-line definition and unit of each headline number, from the "Headline numbers" section of
    docs/DIAGNOSTICS.md (lines ``- `key`: definition; unit``). Empty when the file is missing."""
    try:
        text = doc.read_text(encoding="utf-8")
    except OSError:
        return {}
    section = text.split("## Headline numbers", 1)[-1] if "## Headline numbers" in text else ""
    out = {}
    for line in section.splitlines():
        if line.startswith("## "):
            break
        m = _HELP_LINE.match(line.strip())
        if m:
            out[m.group(1)] = m.group(2)
    return out


def degradation_summary(trace: Trace) -> dict[str, float]:
    """Mean causal-normalised MLA entropy, sink rate (share of MLA heads with first-token mass > 0.3; NaN below
    ``analysis.metrics.attention.MIN_SINK_TOKENS`` tokens, where every head is a sink by construction), mean
    rank-collapse ratio and token cosine over depth, mean Block Influence, worst max/median |h| (first
    sequence); NaN where the trace lacks the data."""
    out = dict.fromkeys(
        (
            "mla_entropy_norm_mean",
            "sink_rate",
            "rank_collapse_mean",
            "token_cosine_mean",
            "block_influence_mean",
            "massive_ratio_max",
        ),
        _NAN,
    )
    if at.has_attention(trace):
        out["mla_entropy_norm_mean"] = float(at.attention_entropy_table(trace)["entropy_norm"].mean())
        if at.attention_tokens(trace) >= at.MIN_SINK_TOKENS:  # fewer keys: "all sinks" by construction
            out["sink_rate"] = at.sink_rate(at.attention_sink_table(trace)["first_token_mass"].to_numpy())
    if names.HIDDEN in trace:
        rc = hs.rank_collapse_table(trace)
        out["rank_collapse_mean"] = float(rc["ratio"].mean())
        out["token_cosine_mean"] = float(rc["token_cosine"].mean())
        if len(rc) > 1:
            out["block_influence_mean"] = float(hs.layer_redundancy_table(trace)["block_influence"].mean())
        h = np.asarray(trace[names.HIDDEN], dtype=np.float64)
        out["massive_ratio_max"] = float(max(hs.max_median_ratio(h[d, 0]) for d in range(h.shape[0])))
    return out


def moe_summary(trace: Trace) -> dict[str, float]:
    """Over the MoE layers (``analysis.metrics.moe.imbalance_table``): max MaxVio and, at that layer's token count,
    the 97.5th percentile of MaxVio under perfectly balanced routing (its sampling floor), mean normalised entropy,
    mean CV and the number of dead experts; NaN without MoE data."""
    table = mo.imbalance_table(trace)
    keys = ("moe_maxvio_max", "moe_maxvio_floor", "moe_entropy_norm_mean", "moe_cv_mean", "moe_dead_experts")
    if table.empty:
        return dict.fromkeys(keys, _NAN)
    worst = table.loc[table["max_vio"].idxmax()]
    return {
        "moe_maxvio_max": float(worst["max_vio"]),
        "moe_maxvio_floor": float(worst["max_vio_floor_hi"]),
        "moe_entropy_norm_mean": float(table["entropy"].mean()),
        "moe_cv_mean": float(table["cv"].mean()),
        "moe_dead_experts": float(table["dead"].sum()),
    }


def attnres_embedding_weight(trace: Trace) -> float:
    """Mean over AttnRes sites of the token-averaged depth weight on the embedding source (NaN without AttnRes)."""
    stats = ar.site_stats(trace)
    return float(stats["embedding_weight"].mean()) if len(stats) else _NAN


def kda_half_life_summary(trace: Trace) -> dict[str, float]:
    """Over every KDA layer, head and key channel of ``analysis.metrics.kda_memory.kda_channel_decay``: mean half-life
    of the channels with a finite one, median half-life, and the share of channels with alpha = 1 (infinite)."""
    h = km.kda_channel_decay(trace)["half_life"].to_numpy(dtype=np.float64)
    if h.size == 0:
        return {"kda_half_life_mean": _NAN, "kda_half_life_median": _NAN, "kda_half_life_inf_share": _NAN}
    finite = h[np.isfinite(h)]
    return {
        "kda_half_life_mean": float(finite.mean()) if finite.size else float("inf"),
        "kda_half_life_median": float(np.median(h)),
        "kda_half_life_inf_share": float(1.0 - finite.size / h.size),
    }


def headline_numbers(ctx: AnalysisContext) -> dict[str, Any]:
    """The run's headline numbers on this trace (NaN where the trace or model lacks the data):

    loss (mean next-token NLL in nats over scored tokens), bits per token = loss / ln 2 (= bits per byte
    for the byte-level vocab), ``degradation_summary``, ``moe_summary``, the mean AttnRes embedding
    weight, ``kda_half_life_summary``, the mean MLA output gate, and the final validation bits/byte from
    metrics.json when present.
    """
    trace = ctx.trace
    out: dict[str, Any] = {"label": ctx.label}
    out["tokens"] = int(trace[names.TOKENS].shape[-1]) if names.TOKENS in trace else 0
    nll = trace.get(names.TOKEN_NLL)
    loss = float(np.nanmean(nll)) if nll is not None and np.isfinite(nll).any() else _NAN
    out["loss"] = loss
    out["bits_per_token"] = loss / math.log(2) if math.isfinite(loss) else _NAN
    out["bits_per_byte"] = out["bits_per_token"] if ctx.config.vocab_size == 256 else _NAN
    out.update(degradation_summary(trace))
    out.update(moe_summary(trace))
    out["attnres_embedding_weight_mean"] = attnres_embedding_weight(trace)
    out.update(kda_half_life_summary(trace))
    try:
        out["mla_gate_mean"] = float(at.mla_gate_table(trace)["gate_mean"].mean())
    except MissingTraceData:
        out["mla_gate_mean"] = _NAN
    if ctx.metrics:
        final = final_numbers(ctx.metrics)
        out["train_final_val_bpb"] = final.get("final_val_bpb", final.get("val_bpb", _NAN))
    return out


# the rows whose delta ``analysis.metrics.loss_noise`` gives a CI for, and each one's unit per nat
_LOSS_ROWS = {"loss": 1.0, "bits_per_token": 1 / math.log(2), "bits_per_byte": 1 / math.log(2)}


def headline_table(
    a: AnalysisContext | dict, b: AnalysisContext | dict, noise: LossNoise | None = None
) -> pd.DataFrame:
    """Headline numbers of two runs with delta = A - B. Columns: metric, description, a, b, delta; with ``noise``
    (``analysis.metrics.loss_noise.headline_noise``) also ``ci95`` (the 95% CI half-width of the delta, in the row's
    unit: loss, bits/token, bits/byte; NaN for other rows) and ``within_noise`` (the CI contains 0; None elsewhere).

    Accepts contexts or already computed ``headline_numbers`` dicts; ``df.attrs`` holds the labels."""
    ha = a if isinstance(a, dict) else headline_numbers(a)
    hb = b if isinstance(b, dict) else headline_numbers(b)
    rows = []
    for key in [k for k in ha if k != "label"] + [k for k in hb if k not in ha and k != "label"]:
        va, vb = _num(ha.get(key)), _num(hb.get(key))
        row = {"metric": key, "description": HEADLINE_LABELS.get(key, key), "a": va, "b": vb, "delta": va - vb}
        if noise is not None:
            scale = _LOSS_ROWS.get(key) if math.isfinite(va - vb) else None
            row["ci95"] = noise.half_width * scale if scale else _NAN
            row["within_noise"] = noise.within_noise if scale else None
        rows.append(row)
    df = pd.DataFrame(rows)
    df.attrs.update(label_a=str(ha.get("label", "A")), label_b=str(hb.get("label", "B")), keys=["metric"])
    return df


@dataclass
class HeadlineComparison:
    """Two runs' headline numbers side by side (``headline_table`` with its ci95 / within_noise columns when the
    loss difference has a noise floor), that noise floor and the one sentence that states it."""

    table: pd.DataFrame
    noise: LossNoise | None
    statement: str | None
    separate_training: bool


def compare_headlines(
    a: AnalysisContext,
    b: AnalysisContext,
    ha: dict | None = None,
    hb: dict | None = None,
    separate_training: bool = False,
) -> HeadlineComparison:
    """``headline_table`` of two traced contexts with the loss difference's 95% CI (``headline_noise``) and its
    ``noise_statement``; ``separate_training``: two separately trained checkpoints, whose seed noise the statement
    adds. ``ha`` / ``hb``: their ``headline_numbers`` when already computed."""
    noise = headline_noise(a, b)
    table = headline_table(a if ha is None else ha, b if hb is None else hb, noise=noise)
    statement = None
    if noise is not None:
        statement = noise_statement(noise, a.config.vocab_size == 256, separate_training)
    return HeadlineComparison(table, noise, statement, separate_training)


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return _NAN
