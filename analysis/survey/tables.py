"""Tidy tables of a survey folder (``analysis.survey.folder.read_survey``): what its figures, report and exports show.

Each function takes a ``Survey`` and returns a pandas DataFrame with one row per (layer, expert / head / site ...,
value); ``export_tables`` writes every one as CSV and JSON; ``summary_text`` is the plain-text report.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.metrics.expert_cache import POLICIES, hit_rate
from analysis.metrics.intervals import wilson_interval
from analysis.metrics.routing_stats import TOKEN_CLASSES, lift, reap_saliency, specialisation
from analysis.survey.aggregates import EMPTY_ID
from analysis.survey.folder import Survey
from analysis.survey.plan import SurveyError
from analysis.survey.state import EDGES, MAXVIO_SCOPES
from k3core.training.load_stats import moe_load_stats
from k3core.utils.files import OutputFolderError, check_output_folder

EXPORT_CARD = "survey_card.json"


def expert_table(survey: Survey) -> pd.DataFrame:
    """Per (layer, expert): tokens routed, load share with its 95% Wilson interval, gate mass, REAP saliency,
    specialisation (bits) and the token class with the highest lift."""
    s, L = survey.state.sums, survey.layout
    rows = []
    tokens = int(s["tokens"][0])
    for i in L.moe_layers:
        p = f"moe.{i}."
        load = s[p + "load"]
        low, high = wilson_interval(load, tokens)
        sal = reap_saliency(s[p + "saliency_sum"], load)
        spec = specialisation(s[p + "class_counts"], s["corpus.class_counts"])
        lifts = lift(s[p + "class_counts"], s["corpus.class_counts"])
        for e in range(L.num_experts):
            best = int(np.nanargmax(lifts[e])) if np.isfinite(lifts[e]).any() else None
            rows.append(
                dict(
                    layer=i,
                    expert=e,
                    tokens=int(load[e]),
                    share=load[e] / tokens if tokens else np.nan,
                    share_low=low[e],
                    share_high=high[e],
                    gate_mass=float(s[p + "gate_mass"][e]),
                    saliency=float(sal[e]),
                    specialisation_bits=float(spec[e]),
                    top_class=TOKEN_CLASSES[best] if best is not None else None,
                    top_lift=float(lifts[e, best]) if best is not None else np.nan,
                )
            )
    return pd.DataFrame(rows)


def maxvio_table(survey: Survey) -> pd.DataFrame:
    """Per MoE layer, MaxVio (max_e c / mean c - 1) at three scopes (loss-free balancing, arXiv 2408.15664): "global"
    (the corpus's whole load), "batch" (each forward's load) and "sequence" (each sequence's load), the last two as
    mean, std and the median / 90th percentile read from their fixed-bin histograms (bin upper edges).
    Columns: layer, scope, max_vio (global: the value; else the mean), std, p50, p90, count."""
    s, L = survey.state.sums, survey.layout
    edges = np.r_[EDGES["maxvio"], np.inf]
    rows = []
    for i in L.moe_layers:
        total = moe_load_stats(s[f"moe.{i}.load"])["max_vio"]
        rows.append(dict(layer=i, scope="global", max_vio=total, std=0.0, p50=total, p90=total, count=1))
        for scope in MAXVIO_SCOPES:
            n, first, second = s[f"moe.{i}.maxvio_{scope}"]
            hist = s[f"moe.{i}.maxvio_{scope}_hist"]
            cum = np.cumsum(hist) / max(hist.sum(), 1)
            mean = first / n if n else np.nan
            std = float(np.sqrt(max(second / n - mean * mean, 0.0))) if n else np.nan
            p50, p90 = (float(edges[np.searchsorted(cum, q)]) if n else np.nan for q in (0.5, 0.9))
            rows.append(dict(layer=i, scope=scope, max_vio=mean, std=std, p50=p50, p90=p90, count=int(n)))
    return pd.DataFrame(rows, columns=["layer", "scope", "max_vio", "std", "p50", "p90", "count"])


def balance_table(survey: Survey) -> pd.DataFrame:
    """Per MoE layer: MaxVio and CV of the load over the corpus (``moe_load_stats``) and the tokens behind them."""
    s, L = survey.state.sums, survey.layout
    rows = [dict(layer=i, tokens=int(s["tokens"][0]), **moe_load_stats(s[f"moe.{i}.load"])) for i in L.moe_layers]
    return pd.DataFrame(rows, columns=["layer", "tokens", "max_vio", "cv"])


def cache_table(survey: Survey) -> pd.DataFrame:
    """Hit rate by cache size and policy, per layer (``scope`` = the layer) and shared over the model
    (``scope`` = "model"); ``size_bytes`` at the checkpoint's storage format (a layer's expert bytes; for the
    model the mean over layers)."""
    s, L = survey.state.sums, survey.layout
    rows = []
    for j, i in enumerate(L.moe_layers):
        acc = int(s[f"moe.{i}.accesses"][0])
        for policy in POLICIES:
            rates = hit_rate(s[f"moe.{i}.cache_{policy}"], acc)
            for size, rate in zip(L.layer_sizes, rates):
                rows.append(
                    dict(
                        scope=str(i),
                        policy=policy,
                        size=size,
                        size_bytes=size * L.expert_bytes[j],
                        hit_rate=rate,
                        accesses=acc,
                    )
                )
    if L.moe_layers:
        acc = int(s["cache.model_accesses"][0])
        mean_bytes = float(np.mean(L.expert_bytes))
        for policy in POLICIES:
            for size, rate in zip(L.model_sizes, hit_rate(s[f"cache.model_{policy}"], acc)):
                rows.append(
                    dict(
                        scope="model",
                        policy=policy,
                        size=size,
                        size_bytes=size * mean_bytes,
                        hit_rate=rate,
                        accesses=acc,
                    )
                )
    return pd.DataFrame(rows)


def context_text(survey: Survey, ids: np.ndarray, mark: int) -> tuple[str, str, str]:
    """(before, token, after) strings of a context window; the token is column ``mark``."""
    strings = survey.layout.token_strings
    show = (lambda t: strings[t]) if strings else (lambda t: f"<{t}>")
    live = [int(t) for t in ids]
    before = "".join(show(t) for t in live[:mark] if t != EMPTY_ID)
    after = "".join(show(t) for t in live[mark + 1 :] if t != EMPTY_ID)
    return before, show(live[mark]), after


def atlas_table(survey: Survey, layer: int | None = None, expert: int | None = None) -> pd.DataFrame:
    """The expert atlas's contexts: per (layer, expert) its top contexts by routing weight (``kind`` "top",
    ``value`` the weight) and its random reservoir (``kind`` "sample"), each as before / token / after text."""
    L, plan = survey.layout, survey.plan
    rows = []
    for i in L.moe_layers:
        if layer is not None and i != layer:
            continue
        for kind, name in (("top", "top_contexts"), ("sample", "reservoir")):
            top = survey.state.tops[f"moe.{i}.{name}"]
            for e in range(L.num_experts):
                if expert is not None and e != expert:
                    continue
                for slot in range(top.k):
                    if top.id[e, slot] == EMPTY_ID:
                        continue
                    before, token, after = context_text(survey, top.payload[e, slot], plan.context_before)
                    rows.append(
                        dict(
                            layer=i,
                            expert=e,
                            kind=kind,
                            rank=slot,
                            position=int(top.id[e, slot]),
                            value=float(top.score[e, slot]),
                            before=before,
                            token=token,
                            after=after,
                        )
                    )
    return pd.DataFrame(
        rows, columns=["layer", "expert", "kind", "rank", "position", "value", "before", "token", "after"]
    )


def lift_table(
    survey: Survey, layer: int | None = None, expert: int | None = None, top_tokens: int = 10
) -> pd.DataFrame:
    """Lift per token class (``kind`` "class") and, where token counts are kept, the tokens with the highest lift
    among those the expert saw at least 5 times (``kind`` "token"), with the counts behind each."""
    s, L = survey.state.sums, survey.layout
    rows = []
    for i in L.moe_layers:
        if layer is not None and i != layer:
            continue
        cls = lift(s[f"moe.{i}.class_counts"], s["corpus.class_counts"])
        tok = lift(s[f"moe.{i}.token_counts"], s["corpus.token_counts"]) if L.count_tokens else None
        for e in range(L.num_experts):
            if expert is not None and e != expert:
                continue
            for c, name in enumerate(TOKEN_CLASSES):
                rows.append(
                    dict(
                        layer=i,
                        expert=e,
                        kind="class",
                        item=name,
                        lift=cls[e, c],
                        count=int(s[f"moe.{i}.class_counts"][e, c]),
                    )
                )
            if tok is not None:
                counts = s[f"moe.{i}.token_counts"][e]
                ok = np.flatnonzero(counts >= 5)
                for t in ok[np.argsort(-tok[e, ok], kind="stable")][:top_tokens]:
                    label = L.token_strings[t] if L.token_strings else f"<{t}>"
                    rows.append(dict(layer=i, expert=e, kind="token", item=label, lift=tok[e, t], count=int(counts[t])))
    return pd.DataFrame(rows, columns=["layer", "expert", "kind", "item", "lift", "count"])


def histogram_table(survey: Survey, what: str) -> pd.DataFrame:
    """A histogram statistic as rows (layer, group, bin_low, bin_high, count): ``what`` is one of "margin", "cutoff",
    "unchosen", "chosen" (MoE, group = expert), "kda_g", "beta" (KDA, group = head), "entropy", "sink" (MLA)."""
    s, L, edges = survey.state.sums, survey.layout, survey.card["edges"]
    spec = {
        "margin": ("moe", "margin_hist", "margin"),
        "cutoff": ("moe", "cutoff_hist", "gap"),
        "unchosen": ("moe", "unchosen_hist", "score"),
        "chosen": ("moe", "chosen_hist", "score"),
        "kda_g": ("kda", "kda_g_hist", "kda_g"),
        "beta": ("kda", "beta_hist", "beta"),
        "entropy": ("mla", "entropy_hist", "entropy"),
        "sink": ("mla", "sink_hist", "sink"),
    }
    if what not in spec:
        raise ValueError(f"unknown histogram {what!r}; choose one of {tuple(spec)}")
    kind, name, edge_key = spec[what]
    e = np.asarray(edges[edge_key], dtype=np.float64)
    lows, highs = np.concatenate([[-np.inf], e]), np.concatenate([e, [np.inf]])
    layers = {"moe": L.moe_layers, "kda": L.kda_layers, "mla": L.mla_layers}[kind]
    rows = []
    for i in layers:
        h = np.atleast_2d(s[f"{kind}.{i}.{name}"])
        for g in range(h.shape[0]):
            for b in range(h.shape[1]):
                rows.append(dict(layer=i, group=g, bin_low=lows[b], bin_high=highs[b], count=int(h[g, b])))
    return pd.DataFrame(rows, columns=["layer", "group", "bin_low", "bin_high", "count"])


def head_table(survey: Survey) -> pd.DataFrame:
    """Per head: KDA mean log decay and mean beta; MLA mean normalised entropy and sink mass (rows >= 1)."""
    s, L = survey.state.sums, survey.layout
    rows = []
    for i in L.kda_layers:
        n = int(s[f"kda.{i}.count"][0])
        channels = max(1, s[f"kda.{i}.kda_g_hist"].sum(1)[0] // max(n, 1))
        for h in range(L.kda_heads):
            rows.append(
                dict(
                    layer=i,
                    kind="KDA",
                    head=h,
                    stat="mean_log_decay",
                    value=s[f"kda.{i}.kda_g_sum"][h] / max(n * channels, 1),
                )
            )
            rows.append(
                dict(layer=i, kind="KDA", head=h, stat="mean_beta", value=s[f"kda.{i}.beta_sum"][h] / max(n, 1))
            )
    T = survey.plan.seq_len
    for i in L.mla_layers:
        seqs = int(s[f"mla.{i}.rows"][0])
        for h in range(L.mla_heads):
            denom = max(seqs * (T - 1), 1)
            rows.append(
                dict(
                    layer=i,
                    kind="MLA",
                    head=h,
                    stat="mean_entropy",
                    value=s[f"mla.{i}.entropy_by_position"][h, 1:].sum() / denom,
                )
            )
            rows.append(
                dict(
                    layer=i,
                    kind="MLA",
                    head=h,
                    stat="mean_sink_mass",
                    value=s[f"mla.{i}.sink_by_position"][h, 1:].sum() / denom,
                )
            )
    return pd.DataFrame(rows, columns=["layer", "kind", "head", "stat", "value"])


def attnres_table(survey: Survey) -> pd.DataFrame:
    """Per AttnRes site and depth source: mean weight and its spread (std over tokens)."""
    s, L = survey.state.sums, survey.layout
    rows = []
    for site, n_src in L.attnres_sites.items():
        n = max(int(s[f"attnres.{site}.count"][0]), 1)
        mean = s[f"attnres.{site}.sum"] / n
        std = np.sqrt(np.maximum(s[f"attnres.{site}.sumsq"] / n - mean**2, 0.0))
        for j in range(n_src):
            rows.append(dict(site=site, source=j, mean=mean[j], std=std[j], tokens=n))
    return pd.DataFrame(rows, columns=["site", "source", "mean", "std", "tokens"])


def position_table(survey: Survey) -> pd.DataFrame:
    """Loss by position (mean over sequences) and, per MLA layer, the mean sink mass by query position."""
    s, L = survey.state.sums, survey.layout
    T = survey.plan.seq_len
    with np.errstate(invalid="ignore", divide="ignore"):
        loss = s["loss.sum"] / s["loss.count"]
    df = pd.DataFrame({"position": np.arange(T), "loss": loss, "sequences": s["loss.count"]})
    for i in L.mla_layers:
        seqs = max(int(s[f"mla.{i}.rows"][0]), 1)
        df[f"sink_mass_layer_{i}"] = s[f"mla.{i}.sink_by_position"].mean(0) / seqs
    return df


TABLES = {
    "experts": expert_table,
    "balance": balance_table,
    "cache": cache_table,
    "atlas": atlas_table,
    "lift": lift_table,
    "heads": head_table,
    "attnres": attnres_table,
    "positions": position_table,
}


def export_tables(survey: Survey, out: str | Path) -> list[Path]:
    """Every table as CSV and JSON (records) into ``out``, plus every histogram; returns the files written."""
    try:  # an earlier export (its survey_card.json) is replaced; nothing else is written over
        out = check_output_folder(out, (EXPORT_CARD,), "survey export", option="--export")
    except OutputFolderError as exc:
        raise SurveyError(str(exc)) from None
    out.mkdir(parents=True, exist_ok=True)
    tables = {name: fn(survey) for name, fn in TABLES.items()}
    for what in ("margin", "cutoff", "unchosen", "chosen", "kda_g", "beta", "entropy", "sink"):
        tables[f"histogram_{what}"] = histogram_table(survey, what)
    written = []
    for name, df in tables.items():
        df.to_csv(out / f"{name}.csv", index=False)
        (out / f"{name}.json").write_text(df.to_json(orient="records"), encoding="utf-8")
        written += [out / f"{name}.csv", out / f"{name}.json"]
    (out / EXPORT_CARD).write_text(json.dumps({k: survey.card[k] for k in ("plan", "run", "complete")}, indent=1))
    written.append(out / EXPORT_CARD)
    return written


def summary_text(survey: Survey) -> str:
    """A plain-text summary: the plan, balance per layer, the most specialised experts, cache hit rates."""
    plan, s = survey.plan, survey.state.sums
    lines = [
        f"survey of {survey.card['run'].get('label')} on {plan.corpus}: {int(s['tokens'][0]):,} of {plan.tokens:,} "
        f"tokens ({len(survey.state.done)}/{plan.batches} batches{'' if survey.complete else ', incomplete'})",
    ]
    bal = balance_table(survey)
    for row in bal.itertuples():
        lines.append(f"  MoE layer {row.layer}: MaxVio {row.max_vio:.3f}, CV {row.cv:.3f}")
    ex = expert_table(survey)
    if len(ex):
        lines.append("  most specialised experts (KL of token classes vs the corpus, bits):")
        for row in ex.sort_values("specialisation_bits", ascending=False).head(5).itertuples():
            lines.append(
                f"    layer {row.layer} expert {row.expert}: {row.specialisation_bits:.3f} bits, "
                f"{row.top_class} x{row.top_lift:.2f}, {row.tokens:,} tokens"
            )
        cache = cache_table(survey)
        model = cache[cache.scope == "model"]
        for policy in POLICIES:
            part = model[model.policy == policy]
            mid = part.iloc[len(part) // 2]
            lines.append(
                f"  shared cache of {int(mid['size'])} experts ({mid.size_bytes / 1e6:.2f} MB): "
                f"{policy} hit rate {mid.hit_rate:.3f}"
            )
    return "\n".join(lines)
