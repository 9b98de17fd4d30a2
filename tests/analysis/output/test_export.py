"""Figure export: offline HTML, CSV and JSON always; PNG/SVG with Chromium, else a clear message."""

from __future__ import annotations

import json
import re

import pandas as pd
import plotly.graph_objects as go
import pytest

from analysis.output import export


def small_figure() -> tuple[go.Figure, pd.DataFrame]:
    df = pd.DataFrame({"layer": [0, 1, 2], "value": [0.5, float("nan"), float("inf")], "kind": ["KDA", "KDA", "MLA"]})
    df.attrs["keys"] = ["layer"]
    fig = go.Figure(go.Bar(x=df["layer"], y=[0.5, 0.1, 0.9], name="value"))
    fig.update_layout(title="test figure", width=400, height=300)
    return fig, df


def test_html_csv_json_are_written_and_html_is_offline(tmp_path):
    fig, df = small_figure()
    res = export.export_figure(fig, df, tmp_path / "out", "my figure/1", formats=("html", "csv", "json"))
    assert set(res) == {"html", "csv", "json"}
    assert all(p.is_file() for p in res.values())
    assert res["html"].name == "my_figure_1.html"
    page = res["html"].read_text()
    assert "Plotly.newPlot" in page and len(page) > 1_000_000  # plotly.js is inline
    assert not re.search(r"<script[^>]+src=", page)  # nothing fetched from a CDN
    back = pd.read_csv(res["csv"])
    assert list(back.columns) == ["layer", "value", "kind"] and back["value"].isna().iloc[1]
    data = json.loads(res["json"].read_text())
    assert data["keys"] == ["layer"] and data["columns"] == ["layer", "value", "kind"]
    assert data["rows"][1]["value"] is None and data["rows"][2]["value"] == "inf"


def test_missing_chromium_gives_a_message_and_other_formats_still_work(tmp_path, monkeypatch):
    monkeypatch.setattr(export, "find_chromium", lambda: None)
    ok, why = export.static_export_available()
    assert not ok and "Chromium" in why
    with pytest.raises(export.ExportUnavailable, match="Chromium"):
        export.require_static_export()
    fig, df = small_figure()
    res = export.export_figure(fig, df, tmp_path, "fig")
    for fmt in ("png", "svg"):
        assert isinstance(res[fmt], str) and "Chromium" in res[fmt]
        assert not (tmp_path / f"fig.{fmt}").exists()
    for fmt in ("html", "csv", "json"):
        assert res[fmt].is_file()
    assert set(export.failures(res)) == {"png", "svg"}


def test_bad_requests_are_rejected(tmp_path):
    fig, df = small_figure()
    with pytest.raises(ValueError, match="unknown export format"):
        export.export_figure(fig, df, tmp_path, "x", formats=("pdf",))
    with pytest.raises(ValueError, match="stem"):
        export.export_figure(fig, df, tmp_path, "..", formats=("csv",))
    res = export.export_figure(fig, None, tmp_path, "nodata", formats=("csv", "json"))
    assert all(isinstance(v, str) for v in res.values())


@pytest.mark.browser
@pytest.mark.slow
def test_static_export_batch_in_one_browser_session(tmp_path):
    ok, why = export.static_export_available()
    if not ok:
        pytest.skip(why)
    items = [(*small_figure(), "a"), (go.Figure(go.Heatmap(z=[[1, 2], [3, 4]])), None, "b")]
    res = export.export_many(items, tmp_path, formats=("png", "svg"))
    assert not export.failures(res), export.failures(res)
    png = res["a"]["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(png[16:20], "big") == 400 * export.DEFAULT_SCALE  # width x scale
    assert "<svg" in res["b"]["svg"].read_text()[:500]


def test_images_that_failed_get_one_more_browser_session(tmp_path, monkeypatch):
    """A first kaleido session that loses one image (as a slow browser start did in CI) is retried for that image
    only; an image that fails every time is tried twice and reported, the others written."""
    import kaleido

    calls = []

    def flaky(items, kopts):  # the first session writes all but the first image
        calls.append([item["path"].name for item in items])
        if len(calls) == 1:
            for item in items[1:]:
                item["path"].write_bytes(b"image")
            return [RuntimeError("ReferenceError: kaleido_scopes is not defined")]
        for item in items:
            item["path"].write_bytes(b"image")
        return []

    monkeypatch.setattr(kaleido, "write_fig_from_object_sync", flaky)
    jobs = [(small_figure()[0], tmp_path / f"{name}.png") for name in ("a", "b", "c")]
    out = export.write_static_batch(jobs, browser_path="/no/browser/needed")
    assert calls == [["a.png", "b.png", "c.png"], ["a.png"]]
    assert all(out[path] == path and path.read_bytes() == b"image" for _, path in jobs)

    calls.clear()

    def always_loses_b(items, kopts):
        calls.append([item["path"].name for item in items])
        for item in items:
            if item["path"].name != "b.png":
                item["path"].write_bytes(b"image")
        return [RuntimeError("b cannot be drawn")]

    monkeypatch.setattr(kaleido, "write_fig_from_object_sync", always_loses_b)
    out = export.write_static_batch(jobs, browser_path="/no/browser/needed")
    assert calls == [["a.png", "b.png", "c.png"], ["b.png"]]
    assert (
        "static export failed for b.png" in out[tmp_path / "b.png"] and "b cannot be drawn" in out[tmp_path / "b.png"]
    )
    assert out[tmp_path / "a.png"] == tmp_path / "a.png" and out[tmp_path / "c.png"] == tmp_path / "c.png"


def test_exported_tables_carry_the_text_and_token_count(tmp_path):
    from analysis.output import export as ex
    from analysis.runs.loading import run_from_model, trace_run
    from analysis.runs.texts import sample_input
    from tests.conftest import nano_model

    model = nano_model()
    run = run_from_model(model)
    ctx = trace_run(run, sample_input("repeat", run.config, 24), label="nano")
    made_on = ex.provenance(ctx)
    assert made_on["run"] == "nano" and made_on["tokens"] == 24 and len(made_on["text"]) > 0
    pair = ex.provenance(ctx, ctx.with_options(label="other"))
    assert (pair["run A"], pair["run B"], pair["tokens B"]) == ("nano", "other", 24)
    df = pd.DataFrame({"position": [0, 1], "value": [0.5, 1.5]})
    fig = go.Figure(go.Scatter(x=df.position, y=df.value))
    written = ex.export_figure(fig, df, tmp_path, "v", ["csv", "json"], meta=made_on)
    pd.testing.assert_frame_equal(pd.read_csv(written["csv"]), df)  # a plain CSV: the meta is in the JSON beside it
    back, head = ex.read_csv_with_provenance(written["csv"])
    pd.testing.assert_frame_equal(back, df)
    assert head["tokens"] == 24 and head["run"] == "nano"
    alone = ex.export_figure(fig, df, tmp_path / "alone", "v", ["csv"], meta=made_on)["csv"]  # no JSON: in columns
    plain = pd.read_csv(alone)
    assert list(plain.columns) == ["meta_run", "meta_text", "meta_tokens", "position", "value"]
    assert plain["meta_run"].tolist() == ["nano", "nano"] and plain["meta_tokens"].tolist() == [24, 24]
    back, head = ex.read_csv_with_provenance(alone)
    pd.testing.assert_frame_equal(back, df)
    assert head["run"] == "nano" and head["text"].startswith(made_on["text"][:50])
    payload = json.loads(written["json"].read_text())
    assert payload["tokens"] == 24 and payload["text"] == made_on["text"] and len(payload["rows"]) == 2
    # a long text is cut, and says so
    long = ctx.with_options()
    long.input_ids = ctx.input_ids.repeat(1, 400)
    cut = ex.provenance(long)["text"]
    assert cut.endswith("characters]") and len(cut) < ex.PROVENANCE_TEXT_CHARS + 80
