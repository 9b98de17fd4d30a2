"""AttnRes diagnostics: depth-softmax weights per site, learned scale/bias per depth, residual growth.

Sites are "i.attn", "i.mlp" (decoder layer i, 0-based) and "output" (the final mix). A site mixes
n sources; in Block AttnRes source j is the bank entry j (0 = the token embedding, j >= 1 = block j)
and the last source is the running partial sum, so source positions line up across sites; in Full
AttnRes source j is the embedding (0) or an earlier sub-layer output. Weights are taken from the
trace arrays ``attnres.<site>`` [batch, token, source], names from ``meta["attnres_sources"]``.

Normalised entropy of a distribution p over n sources: -sum p log p / log n (0 log 0 = 0); it is 1 for
the uniform mix and 0 for a one-hot mix. A site with a single source (n = 1) has nothing to choose
between: its normalised entropy is defined as 0.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.metrics.entropy import normalised_entropy
from k3core.interp.trace import Trace, names
from k3core.modeling.hooks import AttnResSite


def site_order(site: str, num_layers: int | None = None) -> tuple[int, int]:
    """Sort key: (layer, 0 for attn / 1 for mlp); the output site sorts last."""
    where = AttnResSite.parse(site)
    if where.is_output:
        return (num_layers if num_layers is not None else 10**9, 0)
    return (where.layer, 0 if where.sublayer == "attn" else 1)


def sites(trace: Trace) -> list[str]:
    """AttnRes sites recorded in the trace, in depth order."""
    found = [site for name in trace.arrays if (site := names.attnres_site_of(name)) is not None]
    return sorted(found, key=site_order)


def _site_parts(site: str, num_layers: int) -> tuple[int, str]:
    where = AttnResSite.parse(site)
    return (num_layers if where.is_output else where.layer), where.sublayer


def _source_names(trace: Trace, site: str, n: int) -> list[str]:
    recorded = trace.meta.get("attnres_sources", {}).get(site)
    if recorded is None or len(recorded) != n:
        return [f"source {j}" for j in range(n)]
    return list(recorded)


def _num_layers(trace: Trace) -> int:
    return int(trace.config.get("num_hidden_layers", len(trace.meta.get("layer_types", [])) or 0))


def depth_weights(trace: Trace) -> pd.DataFrame:
    """Sites x sources map: mean depth weight p over batch and tokens (tidy).

    Columns: site, layer (num_layers for the output mix), side ("attn" | "mlp" | "output"), order
    (row position), source (position j), source_name (as recorded), source_label (name without
    "(partial)", shared across sites), n_sources, weight.
    """
    L = _num_layers(trace)
    rows = []
    for order, site in enumerate(sites(trace)):
        p = np.asarray(trace[names.attnres(site)], dtype=np.float64)  # [B, T, n]
        n = p.shape[-1]
        mean = p.reshape(-1, n).mean(0)
        source_names = _source_names(trace, site, n)
        layer, side = _site_parts(site, L)
        for j in range(n):
            rows.append(
                dict(
                    site=site,
                    layer=layer,
                    side=side,
                    order=order,
                    source=j,
                    source_name=source_names[j],
                    source_label=source_names[j].replace(" (partial)", ""),
                    n_sources=n,
                    weight=mean[j],
                )
            )
    return pd.DataFrame(
        rows, columns=["site", "layer", "side", "order", "source", "source_name", "source_label", "n_sources", "weight"]
    )


def weight_matrix(weights: pd.DataFrame) -> tuple[np.ndarray, list[str], list[str]]:
    """(matrix [sites, max sources] with NaN where a site has fewer sources, site names, source labels)."""
    site_names = list(dict.fromkeys(weights.sort_values("order")["site"]))
    n = int(weights["source"].max()) + 1 if len(weights) else 0
    mat = np.full((len(site_names), n), np.nan)
    labels = [f"source {j}" for j in range(n)]
    idx = {s: r for r, s in enumerate(site_names)}
    for row in weights.itertuples():
        mat[idx[row.site], row.source] = row.weight
        if not row.source_name.endswith("(partial)"):
            labels[row.source] = row.source_label
    return mat, site_names, labels


def site_stats(trace: Trace) -> pd.DataFrame:
    """Per site, from the depth weights p [batch, token, n]:

    - entropy: normalised entropy of the token-averaged p (the heatmap row);
    - token_entropy: mean over tokens of each token's normalised entropy (how sharp single mixes are);
    - max_weight: max_j of the token-averaged p; argmax: its source position;
    - embedding_weight: token-averaged p_0 (the embedding, the "depth sink");
    - recent_weight: token-averaged p of the last source (the running partial sum);
    - query_norm: ||w|| of the site's pseudo-query (0 at init: uniform mix), NaN if not recorded.
    """
    L = _num_layers(trace)
    rows = []
    for order, site in enumerate(sites(trace)):
        p = np.asarray(trace[names.attnres(site)], dtype=np.float64)
        n = p.shape[-1]
        flat = p.reshape(-1, n)
        mean = flat.mean(0)
        layer, side = _site_parts(site, L)
        qn = trace.get(names.attnres_query_norm(site))
        rows.append(
            dict(
                site=site,
                layer=layer,
                side=side,
                order=order,
                n_sources=n,
                entropy=float(normalised_entropy(mean)),
                token_entropy=float(normalised_entropy(flat).mean()),
                max_weight=float(mean.max()),
                argmax=int(mean.argmax()),
                embedding_weight=float(mean[0]),
                recent_weight=float(mean[-1]),
                query_norm=float(qn) if qn is not None else np.nan,
            )
        )
    return pd.DataFrame(
        rows,
        columns=[
            "site",
            "layer",
            "side",
            "order",
            "n_sources",
            "entropy",
            "token_entropy",
            "max_weight",
            "argmax",
            "embedding_weight",
            "recent_weight",
            "query_norm",
        ],
    )


def hidden_rms_by_depth(trace: Trace) -> pd.DataFrame:
    """RMS sqrt(mean_c h^2) of the hidden state entering each layer (depth 0..L-1) and of the final
    state (depth L, before the last RMSNorm), over batch and tokens: mean, median, p10, p90, max.

    Columns: depth, label ("L<i> in" | "final"), mean, median, p10, p90, max.
    """
    if names.HIDDEN_RMS not in trace:
        return pd.DataFrame(columns=["depth", "label", "mean", "median", "p10", "p90", "max"])
    rms = np.asarray(trace[names.HIDDEN_RMS], dtype=np.float64)  # [depth, B, T]
    D = rms.shape[0]
    rows = []
    for k in range(D):
        r = rms[k].ravel()
        rows.append(
            dict(
                depth=k,
                label="final" if k == D - 1 else f"L{k} in",
                mean=r.mean(),
                median=np.median(r),
                p10=np.quantile(r, 0.1),
                p90=np.quantile(r, 0.9),
                max=r.max(),
            )
        )
    return pd.DataFrame(rows)
