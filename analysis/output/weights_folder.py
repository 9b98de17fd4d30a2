"""The weights report: the output folder of ``k3lab weights`` (``weights.json``, each weights view under
``figures/`` and an offline ``index.html`` with every figure), the weight-only counterpart of
``analysis.output.report``."""

from __future__ import annotations

import html as _html
from pathlib import Path
from typing import Any

from analysis.output.export import export_many
from analysis.output.format import format_bytes
from analysis.runs.context import AnalysisContext
from analysis.views.catalogue import section_views
from analysis.views.view import NotApplicable
from analysis.weights.document import weights_json, write_weights_json
from analysis.weights.summary import WeightSummary
from k3core.utils.files import check_output_folder

WEIGHTS_JSON = "weights.json"


def check_weights_folder(out: str | Path) -> Path:
    """``out`` when a weights folder may be written there (``check_output_folder``: an earlier weights folder
    is replaced); OutputFolderError (a ValueError) otherwise."""
    return check_output_folder(out, (WEIGHTS_JSON,), "weights folder")


def write_outputs(summary: WeightSummary, out_dir: str | Path, static: bool = True) -> dict[str, Any]:
    """Write ``weights.json``, every applicable weights view under ``figures/`` (offline HTML, CSV and, when
    ``static`` and Chromium are available, PNG and SVG) and ``index.html`` (all figures on one offline page).

    Returns {"json": Path, "index": Path, "figures": {view key: {format: Path or message}},
    "not_applicable": {view key: reason}, "errors": {view key: message}}."""
    out = check_weights_folder(out_dir)
    (out / "figures").mkdir(parents=True, exist_ok=True)
    json_path = write_weights_json(summary, out / WEIGHTS_JSON)
    ctx = AnalysisContext(trace=None, config=summary.config, label=summary.label, weights=summary)
    built, skipped, errors = [], {}, {}
    for view in section_views("weights"):
        try:
            fig, df = view.build(ctx)
        except NotApplicable as exc:
            skipped[view.key] = str(exc)
            continue
        except Exception as exc:  # noqa: BLE001 - one broken figure must not lose the others
            errors[view.key] = f"{type(exc).__name__}: {exc}"
            continue
        built.append((view, fig, df))
    formats = ("html", "csv", "png", "svg") if static else ("html", "csv")
    files = export_many([(fig, df, view.key) for view, fig, df in built], out / "figures", formats=formats)

    doc = weights_json(summary)
    rows = [
        ("checkpoint", summary.path or summary.label),
        ("parameters (text model, from headers)", f"{summary.total_params:,}"),
        ("declared bytes", f"{summary.bytes_total:,} ({format_bytes(summary.bytes_total)})"),
        (
            "bytes read",
            f"{summary.bytes_read:,} ({format_bytes(summary.bytes_read)}, "
            f"{100 * summary.bytes_read / max(summary.bytes_total, 1):.4f}% of declared)",
        ),
        ("seconds", f"{summary.seconds:.2f}"),
        (
            "decoder layers",
            f"{summary.num_layers} ({(summary.structure['mixer'] == 'kda').sum()} KDA, "
            f"{(summary.structure['mixer'] == 'mla').sum()} MLA; "
            f"{(summary.structure['ffn'] == 'moe').sum()} MoE)",
        ),
        ("skipped tensors (not the text model)", str(len(summary.skipped))),
        (
            "output-mix pseudo-query norm",
            "—" if doc["output_attn_res_query_norm"] is None else f"{doc['output_attn_res_query_norm']:.4g}",
        ),
    ]
    body = [
        "<h1>Weight-only diagnostics: " + _html.escape(summary.label) + "</h1>",
        "<table>"
        + "".join(f"<tr><th>{_html.escape(k)}</th><td>{_html.escape(v)}</td></tr>" for k, v in rows)
        + "</table>",
    ]
    for note in summary.notes:
        body.append(f"<p class='note'>{_html.escape(note)}</p>")
    body.append(
        "<p>Data: <a href='weights.json'>weights.json</a>. Each figure below also has its own files "
        "in <code>figures/</code>.</p>"
    )
    first = True
    for view, fig, _ in built:
        links = " · ".join(
            f"<a href='figures/{p.name}'>{fmt.upper()}</a>"
            if isinstance(p, Path)
            else f"<span title='{_html.escape(str(p))}'>{fmt.upper()}: not written</span>"
            for fmt, p in files.get(view.key, {}).items()
        )
        body.append(
            f"<section id='{view.key}'><h2>{_html.escape(view.title)}</h2>"
            f"<p class='caption'>{_html.escape(view.description)}</p>"
            + fig.to_html(full_html=False, include_plotlyjs=first, config={"displaylogo": False})
            + f"<p class='files'>{links}</p></section>"
        )
        first = False
    for key, reason in skipped.items():
        body.append(f"<p class='note'>{_html.escape(key)}: not applicable: {_html.escape(reason)}</p>")
    for key, message in errors.items():
        body.append(f"<p class='error'>{_html.escape(key)}: failed: {_html.escape(message)}</p>")
    style = (
        "body{font-family:Inter,Helvetica,Arial,sans-serif;max-width:1200px;margin:2em auto;color:#222}"
        "table{border-collapse:collapse}th,td{padding:3px 10px;border-bottom:1px solid #ddd;text-align:left}"
        ".caption{color:#444}.note{color:#666}.error{color:#b00}.files{font-size:90%}"
    )
    index = out / "index.html"
    index.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>k3lab weights: "
        f"{_html.escape(summary.label)}</title><style>{style}</style></head><body>"
        + "\n".join(body)
        + "</body></html>\n",
        encoding="utf-8",
    )
    return {"json": json_path, "index": index, "figures": files, "not_applicable": skipped, "errors": errors}
