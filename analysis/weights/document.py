"""The ``weights.json`` document: a weight summary in a stable format, and its writer."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .summary import WeightSummary


def _finite_or_none(x: Any) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


_HALF_LIFE_FIELDS = {"median": "half_life_median", "p10": "half_life_p10", "p90": "half_life_p90"}
_BIAS_FIELDS = {"mean": "mean", "std": "std", "min": "min", "max": "max"}


def _fields(row: Any, fields: dict[str, str]) -> dict[str, float | None] | None:
    """``{key: row.column}`` for each ``fields`` item (non-finite numbers as None); None without a row."""
    return None if row is None else {key: _finite_or_none(getattr(row, col)) for key, col in fields.items()}


def weights_json(summary: WeightSummary) -> dict[str, Any]:
    """The ``weights.json`` document (stable format; non-finite numbers become null):

    {"total_params": int, "bytes_total": int, "bytes_read": int, "seconds": float,
     "skipped_tensors": [str], "output_attn_res_query_norm": float|null,
     "layers": [{"index": int (0-based), "mixer": "kda"|"mla", "ffn": "dense"|"moe", "params": int,
                 "kda_half_life": {"median": float, "p10": float, "p90": float}|null,
                 "attn_res_query_norm": float|null, "mlp_res_query_norm": float|null,
                 "router_bias": {"mean": float, "std": float, "min": float, "max": float}|null}]}
    """
    qn = summary.query_norms
    qmap = {(int(r.layer), r.site): float(r.query_norm) for r in qn.itertuples()}
    kda = {int(r.layer): r for r in summary.kda_layers.itertuples()}
    rb = {int(r.layer): r for r in summary.router_bias_stats.itertuples()}
    layers = []
    for r in summary.structure.itertuples():
        i = int(r.layer)
        layers.append(
            {
                "index": i,
                "mixer": r.mixer,
                "ffn": r.ffn,
                "params": int(r.params),
                "kda_half_life": _fields(kda.get(i), _HALF_LIFE_FIELDS),
                "attn_res_query_norm": _finite_or_none(qmap.get((i, "attn"))),
                "mlp_res_query_norm": _finite_or_none(qmap.get((i, "mlp"))),
                "router_bias": _fields(rb.get(i), _BIAS_FIELDS),
            }
        )
    return {
        "total_params": int(summary.total_params),
        "bytes_total": int(summary.bytes_total),
        "bytes_read": int(summary.bytes_read),
        "seconds": float(summary.seconds),
        "skipped_tensors": list(summary.skipped),
        "output_attn_res_query_norm": _finite_or_none(qmap.get((summary.num_layers, "output"))),
        "layers": layers,
    }


def write_weights_json(summary: WeightSummary, path: str | Path) -> Path:
    """Write ``weights_json(summary)`` (indented, UTF-8)."""
    path = Path(path)
    path.write_text(json.dumps(weights_json(summary), indent=1) + "\n")
    return path
