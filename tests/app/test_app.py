"""The Streamlit app, run headless with streamlit.testing's AppTest on real k3-nano checkpoints (no mocks).

Every page must render without an exception; bad input (a corrupt checkpoint, NaN weights, empty text,
a bad upload) must show an st.error element and leave the app running. Texts are cut to a few tokens
so the whole file stays fast.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from streamlit.runtime import caching as st_caching

from analysis.compare.two_runs import quantised_copy
from analysis.runs import loading as runs_mod
from analysis.runs import texts
from analysis.views.catalogue import section_views
from app.library import run_list
from app.render import caching, cards, page_scaffold, view_cache
from app.render.model_use import model_use
from app.server import job_budget
from app.state import inputs
from k3core.data.batches import IGNORE_INDEX
from k3core.modeling.model import K3ForCausalLM
from tests.app.apptest_helpers import MAX_TOKENS, TIMEOUT, charts, errors, make_app, open_page


def test_overview_renders_by_default(app_env, runs):
    """The default page, then Compare and history; every registered page opens in tests/app/test_page_registry.py."""
    app_env(runs["good"], runs["other"])
    at = make_app()
    at.session_state["k3lab_cmp_section"] = "attnres"  # density (importance) is covered on its own page
    at.run()
    assert not at.exception, at.exception
    assert errors(at) == []
    # The first preloaded run is selected and the Overview renders without any click.
    assert at.session_state["k3lab_run"] == "nano-a"
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Layers"] == "4"
    assert metrics["Parameters"].endswith("K")
    assert "loss (nats/token)" in metrics and metrics["loss (nats/token)"] != "n/a"
    assert any("nano seed 0" in m.value for m in at.markdown)  # the model card

    # Compare defaulted to the other run; history overlays both runs' metrics.json.
    open_page(at, "compare")
    assert at.selectbox(key="k3lab_cmp_run_b").value == "nano-b"
    assert len(at.dataframe) >= 1  # headline delta table
    # its noise floor: a paired CI over the shared text, and the seed noise of two separately trained runs
    notes = [m.value for m in (*at.info, *at.caption) if "95% CI" in m.value]
    from analysis.metrics.loss_noise import SEED_NOISE_BPB

    assert len(notes) == 1 and "paired" in notes[0] and f"{SEED_NOISE_BPB} bits/byte" in notes[0], notes
    assert "± (95% CI)" in at.dataframe[0].value.columns
    open_page(at, "history")
    assert charts(at) >= 1


def test_the_recording_checkbox_says_what_it_records_and_what_it_costs(app_env, runs):
    """It records KDA's implicit attention as well as the attention maps (not MLA only), and its label and help say
    the cost."""
    app_env(runs["good"])
    at = make_app().run()
    box = at.checkbox(key="k3lab_record_attn")
    assert box.label == inputs.ATTENTION_CHECKBOX and "KDA implicit attention" in box.label and "7x" in box.label
    assert "MLA and KDA attention maps" in box.help and "O(T^2 K)" in box.help
    assert "kda_attn" in caching.trace_items(True) and "kda_attn" not in caching.trace_items(False)


def test_clear_cache_clears_the_kept_results(app_env, runs):
    """Streamlit's "Clear cache" (the menu, or C) runs cache_resource.clear() (AppSession._handle_clear_cache_request):
    the traced contexts and figures in app.server.kept_results, which no Streamlit cache holds, go with it."""
    app_env(runs["good"])
    at = make_app().run()
    assert not at.exception, at.exception
    kept = job_budget.budget().kept
    for _ in range(2):  # twice: the next script run ties the kept results to the next clear again
        # the page's background builds (app.render.prefetch) keep what they build: finished first, or one that ends
        # after the clear keeps its figure again (53,296 bytes in one loaded full-suite run)
        for thread in [t for t in threading.enumerate() if t.name == "k3lab-prefetch"]:
            thread.join(timeout=TIMEOUT)
        assert kept.kept_bytes > 0  # the Overview's trace and figures
        st_caching.cache_resource.clear()
        assert kept.kept_bytes == 0
        at.run()
        assert not at.exception, at.exception


def test_compare_one_run_on_two_texts(app_env, runs):
    app_env(runs["good"])
    at = make_app()
    at.session_state["k3lab_cmp_mode"] = "One run, two texts"
    at.session_state["k3lab_cmp_section"] = "moe"
    at.run()
    open_page(at, "compare")
    assert not at.exception
    assert errors(at) == []
    assert at.selectbox(key="k3lab_cmp_text_source").value == inputs.TEXT_MQAR
    assert charts(at) >= 2
    assert any("**B** = MQAR:" in c.value for c in at.caption)  # labelled once, never "B: B: MQAR"
    assert not any("B: B:" in c.value for c in at.caption)
    # MQAR scores its 6 answers only: too few for windows, and said so; one run on two texts has no seed noise
    notes = [m.value for m in (*at.info, *at.caption) if m.value.startswith("A - B =")]
    assert len(notes) == 1 and "too few tokens" in notes[0] and "seed" not in notes[0], notes


def test_compare_b_can_be_the_untrained_twin_of_a(app_env, runs):
    app_env(runs["good"], runs["other"])
    at = make_app()
    at.session_state["k3lab_cmp_section"] = "degradation"
    at.run()
    open_page(at, "compare")
    at.toggle(key="k3lab_cmp_twin").set_value(True).run()
    assert not at.exception and errors(at) == []
    assert any(c.value.startswith("**A** = nano") and "untrained twin" in c.value for c in at.caption)
    titles = [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]
    assert titles and all("vs nano-a (untrained twin)" in t.replace("<br>", " ") for t in titles), titles[:2]


def test_compare_builds_an_a_minus_b_chart_only_when_its_expander_is_opened(app_env, runs):
    """A closed expander's contents cost the browser as much as shown ones (issue 27 speed): Compare's A - B charts
    are built when their expander is opened (its state is the session key), and the page keeps the side-by-side
    charts either way."""
    app_env(runs["good"], runs["other"])
    at = make_app()
    at.session_state["k3lab_cmp_section"] = "attnres"
    at.run()
    open_page(at, "compare")
    assert not at.exception and errors(at) == []
    diffs = [e for e in at.expander if e.label.startswith("Difference A - B: ")]
    assert diffs and all(len(e.get("plotly_chart")) == 0 for e in diffs)
    closed = charts(at)
    first = diffs[0].label.removeprefix("Difference A - B: ")
    view = next(v for v in section_views("attnres") if v.title == first)
    at.session_state[f"k3lab_diff_{view.key}"] = True  # what opening it in the browser sets
    at.run()
    assert not at.exception and errors(at) == []
    opened = next(e for e in at.expander if e.label == diffs[0].label)
    assert len(opened.get("plotly_chart")) == 1
    assert charts(at) == closed + 1


def test_overview_builds_its_tables_only_when_opened(app_env, runs):
    """The Overview's layer table and every-config-field JSON are built when their expander is opened."""
    app_env(runs["good"])
    at = make_app().run()
    assert not at.exception and errors(at) == []
    shut = {e.label: e for e in at.expander}
    assert len(shut["Layer table"].get("dataframe")) == 0 and len(shut["Every config field"].get("json")) == 0
    at.session_state["k3lab_overview_layer_table"] = True
    at.session_state["k3lab_overview_config_fields"] = True
    at.run()
    assert not at.exception and errors(at) == []
    shown = {e.label: e for e in at.expander}
    assert len(shown["Layer table"].get("dataframe")) == 1
    assert '"num_hidden_layers": 4' in shown["Every config field"].get("json")[0].value


def test_overview_builds_the_headline_table_only_when_opened(app_env, runs):
    """ "All headline numbers" (a data grid and its downloads) is built when its expander is opened."""
    app_env(runs["good"])
    at = make_app().run()
    assert not at.exception and errors(at) == []
    assert len({e.label: e for e in at.expander}["All headline numbers"].get("dataframe")) == 0
    at.session_state["k3lab_headline_table"] = True
    at.run()
    assert not at.exception and errors(at) == []
    grid = {e.label: e for e in at.expander}["All headline numbers"].get("dataframe")
    assert len(grid) == 1 and "loss (nats/token)" in set(grid[0].value["metric"])


def test_overview_draws_the_layer_map_from_the_config_before_the_weights(app_env, runs):
    """The layer map comes from config.json before the run loads (the cold open's first chart), so a checkpoint
    whose weights cannot be read still shows it, above the weights' error."""
    app_env(runs["corrupt"])
    at = make_app().run()
    assert not at.exception
    assert any("not a safetensors file" in e for e in errors(at)), errors(at)
    assert charts(at) == 1  # Allocated density per layer
    assert any("Layer map" in m.value for m in at.markdown)


@pytest.mark.parametrize(("which", "message"), [("corrupt", "not a safetensors file"), ("nan", "NaN or Inf")])
def test_bad_checkpoint_shows_error_not_exception(app_env, runs, which, message):
    app_env(runs[which], runs["good"])
    at = make_app().run()
    assert not at.exception
    assert any(message in e for e in errors(at)), errors(at)
    open_page(at, "moe")
    assert not at.exception
    assert any(message in e for e in errors(at))
    # The app keeps running: the other run still works.
    at.session_state["k3lab_run"] = "nano-a"
    open_page(at, "overview")
    assert not at.exception and errors(at) == []


def test_empty_and_huge_text(app_env, runs):
    app_env(runs["good"])
    at = make_app()
    at.session_state["k3lab_text_source"] = inputs.TEXT_PASTE
    at.run()
    assert not at.exception
    assert any("The text is empty" in e for e in errors(at))
    open_page(at, "degradation")
    assert any("The text is empty" in e for e in errors(at))
    assert charts(at) == 0

    at.session_state["k3lab_paste"] = "to be or not to be " * 500  # 9,500 bytes
    at.run()
    assert not at.exception and errors(at) == []
    assert any(f"first {MAX_TOKENS} of 9,500 tokens" in w.value for w in at.warning)
    assert charts(at) >= 2


def test_generate_page(app_env, runs):
    app_env(runs["good"])
    at = make_app().run()
    open_page(at, "generate")
    at.text_area(key="k3lab_prompt").input("ROMEO:")
    at.slider(key="k3lab_gen_tokens").set_value(12)
    at.button[0].click().run()
    assert not at.exception and errors(at) == []
    out = [c.value for c in at.code]
    assert out and out[-1].startswith("ROMEO:")
    assert {m.label for m in at.metric} >= {"New tokens", "Decode cache"}
    assert [m.value for m in at.metric if m.label == "New tokens"] == ["12"]
    # A Stop ends the script while it streams: what was kept so far (every 16 tokens) is shown as stopped, with its
    # heading, speed, cache and download, on the next run.
    kept = {**at.session_state["k3lab_generated"], "text": "abc", "new": 16, "asked": 200, "done": False}
    at.session_state["k3lab_generated"] = kept
    at.run()
    assert any("stopped: 16 of 200 new tokens" in c.value for c in at.caption), [c.value for c in at.caption]
    assert {m.label for m in at.metric} >= {"New tokens", "Speed", "Decode cache"}
    assert [m.value for m in at.metric if m.label == "New tokens"] == ["16"]
    assert any(h.value.startswith("#### Output of") for h in at.markdown)


def test_generate_completes_at_its_defaults(app_env, runs):
    """The default 200 new tokens redraw the live output (and its download button) every 16 tokens: each redraw must
    have its own element id (today's code stopped after 32 tokens with StreamlitDuplicateElementId)."""
    app_env(runs["good"])
    at = make_app().run()
    open_page(at, "generate")
    at.button[0].click().run()
    assert not at.exception and errors(at) == []
    assert [m.value for m in at.metric if m.label == "New tokens"] == ["200"]
    assert at.session_state["k3lab_generated"]["done"] is True


# ------------------------------------------------------------------------------------ pure helpers
def test_discover_runs_order_dedupe_and_problems(tmp_path, runs):
    samples = tmp_path / "samples"
    samples.mkdir()
    shutil.copytree(runs["good"], samples / "nano-a")  # same name as a preloaded run: gets a suffix
    (samples / "not-a-run").mkdir()
    env = os.pathsep.join([str(runs["other"]), str(tmp_path / "missing"), str(runs["other"])])
    uploaded = [run_list.RunRef("up", str(runs["good"]), "uploaded")]
    found, problems = run_list.discover_runs(env, samples, uploaded)
    assert [(r.label, r.origin) for r in found] == [("nano-b", "preloaded"), ("nano-a", "sample"), ("up", "uploaded")]
    assert len(problems) == 1 and "missing" in problems[0]
    found, _ = run_list.discover_runs(str(runs["good"]), samples)
    assert [r.label for r in found] == ["nano-a", "nano-a (2)"]
    # a shipped sample opened by path under a new name is listed (and linkable) under that name; under its own
    # folder name it is not listed twice
    by_path = [
        run_list.RunRef("my-sample", str(samples / "nano-a"), "path"),
        run_list.RunRef("nano-a", str(samples / "nano-a"), "path"),
    ]
    found, _ = run_list.discover_runs(None, samples, by_path)
    assert [(r.label, r.origin) for r in found] == [("nano-a", "sample"), ("my-sample", "path")]
    # A folder of runs expands to its checkpoint folders.
    found, problems = run_list.discover_runs(str(runs["good"].parent), None)
    assert [r.label for r in found] == ["corrupt", "nan-weights", "nano-a", "nano-b"] and not problems


def test_text_checks_and_token_digest():
    with pytest.raises(inputs.InputError, match="empty"):
        inputs.check_text(inputs.TextChoice(inputs.TEXT_PASTE, 64, "  \n"))
    with pytest.raises(inputs.InputError, match="between 2 and"):
        inputs.check_text(inputs.TextChoice(inputs.TEXT_SHAKESPEARE, inputs.MAX_TOKENS_CAP + 1))
    with pytest.raises(inputs.InputError, match="binary"):
        inputs.decode_upload(b"abc\x00def", "x.txt")
    with pytest.raises(inputs.InputError, match="not UTF-8"):
        inputs.decode_upload(b"caf\xe9", "x.txt")
    ids = torch.arange(5)[None]
    digest = texts.Input("a", ids).digest
    assert digest == texts.Input("b", ids.clone()).digest
    assert digest != texts.Input("a", ids, targets=torch.full_like(ids, IGNORE_INDEX)).digest
    assert digest != texts.Input("a", torch.arange(1, 6)[None]).digest
    # Same text and length, same cache key; any change, a new key.
    a = inputs.TextChoice(inputs.TEXT_PASTE, 64, "hello")
    assert a.key() == inputs.TextChoice(inputs.TEXT_PASTE, 64, "hello").key()
    assert a.key() != inputs.TextChoice(inputs.TEXT_PASTE, 65, "hello").key()
    assert a.key() != inputs.TextChoice(inputs.TEXT_PASTE, 64, "hellp").key()


def test_options_are_checked():
    inputs.check_options({"seq_len": 4096})
    with pytest.raises(inputs.InputError, match="unknown option"):
        inputs.check_options({"seqlen": 4096})
    with pytest.raises(inputs.InputError, match="seq_len"):
        inputs.check_options({"seq_len": 10})


def test_exports_without_chromium_offer_html_csv_json(app_env, runs, monkeypatch):
    from analysis.output import export

    monkeypatch.setattr(export, "find_chromium", lambda: None)
    cards.static_export_status.cache_clear()
    try:
        app_env(runs["good"])
        at = make_app().run()
        open_page(at, "attnres")
        assert not at.exception and errors(at) == []
        keys = [b.key for b in at.get("download_button")]
        formats = {k.rsplit("-", 1)[-1] for k in keys}
        assert formats == {"html", "csv", "json"}, keys
        assert any("need Chromium" in c.value or "needs Chromium" in c.value for c in at.caption)
        # The export files themselves (built on click in the browser) hold the figure's data.
        run = run_list.RunRef("nano-a", str(runs["good"]), "preloaded")
        loaded = caching.load(run, inputs.TextChoice(inputs.TEXT_SHAKESPEARE, 32))
        fig, df = view_cache.build_view(section_views("attnres")[0], loaded)
        assert cards.figure_bytes(fig, df, "t", "csv").decode().splitlines()[0].split(",") == list(df.columns)
        assert b"<html" in cards.figure_bytes(fig, df, "t", "html")[:500].lower()
    finally:
        cards.static_export_status.cache_clear()


# ------------------------------------------------------------------------------------ one run-and-trace path
def test_two_pickle_checkpoints_with_one_config_differ_through_the_app_path(tmp_path):
    """Two pytorch_model.bin checkpoints (plain state dicts, same config, same size and mtime) get two
    fingerprints, two cached runs and two outputs through the app's cached loaders."""
    folders = []
    for seed in (10, 11):
        torch.manual_seed(seed)
        model = K3ForCausalLM.from_config("k3-nano")
        folder = tmp_path / f"bin-{seed}"
        model.save_pretrained(folder)
        (folder / "model.safetensors").unlink()
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, folder / "pytorch_model.bin")
        folders.append(folder)
    a, b = (folder / "pytorch_model.bin" for folder in folders)
    assert (
        a.stat().st_size == b.stat().st_size
        and (folders[0] / "config.json").read_bytes() == (folders[1] / "config.json").read_bytes()
    )
    stamp = a.stat().st_mtime_ns
    for file in (a, b):
        os.utime(file, ns=(stamp, stamp))  # only the bytes differ
    refs = [run_list.RunRef(f"bin-{i}", str(folder), "preloaded") for i, folder in enumerate(folders)]
    fingerprints = [caching.run_fingerprint(ref.path) for ref in refs]
    assert fingerprints[0] != fingerprints[1]
    choice = inputs.TextChoice(inputs.TEXT_SHAKESPEARE, 32)
    loaded = [caching.load(ref, choice) for ref in refs]
    assert [item.run.fingerprint for item in loaded] == fingerprints
    assert loaded[0].run.model is not loaded[1].run.model
    assert loaded[0].key != loaded[1].key
    nll = [item.ctx.trace["token_nll"] for item in loaded]
    assert not np.allclose(nll[0], nll[1])
    assert loaded[0].ctx.loss != loaded[1].ctx.loss
    # the same folder again: the same cached objects, no second load or trace
    again = caching.load(refs[0], choice)
    assert again.run is loaded[0].run and again.ctx.trace is loaded[0].ctx.trace


def test_loaded_context_is_the_traced_one_with_the_page_options(app_env, runs):
    ref = run_list.RunRef("nano-a", str(runs["good"]), "preloaded")
    choice = inputs.TextChoice(inputs.TEXT_MQAR, 40)
    small = caching.load(ref, choice, options={"seq_len": 1024})
    large = caching.load(ref, choice, options={"seq_len": 4096}, label="other label")
    # one trace, one token tensor, shared; only the label and options differ
    assert small.ctx.trace is large.ctx.trace and small.ctx.input_ids is large.ctx.input_ids
    assert small.ctx.input_ids is small.tokens.input_ids
    assert (small.ctx.options["seq_len"], large.ctx.options["seq_len"]) == (1024, 4096)
    assert large.ctx.label == "other label" and small.ctx.label == "nano-a"
    assert small.key != large.key
    assert (small.run.device, small.run.dtype) == ("cpu", "float32")


# ------------------------------------------------------------------------------------ links (query parameters)
def test_a_link_opens_the_same_run_text_and_tokens(app_env, runs):
    app_env(runs["good"], runs["other"])
    at = make_app()
    at.query_params.update({"run": "nano-b", "text": "mqar", "tokens": "40", "seq": "4096"})
    at.run()
    assert not at.exception and errors(at) == []
    assert at.session_state["k3lab_run"] == "nano-b"
    assert at.session_state["k3lab_text_source"] == inputs.TEXT_MQAR
    assert at.session_state["k3lab_max_tokens"] == 40
    assert at.session_state["k3lab_seq_len"] == 4096
    assert [s.value for s in at.subheader][0] == "nano-b"
    assert any("nano-b" in c.value and "MQAR" in c.value for c in at.caption)
    # the app writes its state back into the URL (what a copied link holds)
    assert {k: at.query_params[k] for k in ("run", "text", "tokens", "seq")} == {
        "run": "nano-b",
        "text": "mqar",
        "tokens": "40",
        "seq": "4096",
    }


def test_a_link_with_unknown_values_warns_and_falls_back(app_env, runs):
    app_env(runs["good"], runs["other"])
    at = make_app()
    at.query_params.update({"run": "no-such-run", "text": "poetry", "tokens": "999999", "colour": "red"})
    at.run()
    assert not at.exception and errors(at) == []
    warnings = " ".join(w.value for w in at.warning).replace("\\", "")  # the notes are Markdown-escaped
    for shown in ("'no-such-run'", "'poetry'", "'999999'", "'colour'"):
        assert shown in warnings, (shown, warnings)
    assert at.session_state["k3lab_run"] == "nano-a"  # the default
    assert at.session_state["k3lab_text_source"] == inputs.TEXT_SHAKESPEARE
    assert at.query_params["run"] == "nano-a"


def test_compare_choices_are_in_the_link(app_env, runs):
    app_env(runs["good"], runs["other"])
    at = make_app()
    at.query_params.update({"b": "nano-a", "section": "moe", "mode": "runs"})
    at.run()
    at.session_state["k3lab_run"] = "nano-b"
    open_page(at, "compare")
    assert not at.exception and errors(at) == []
    assert at.selectbox(key="k3lab_cmp_run_b").value == "nano-a"
    assert at.radio(key="k3lab_cmp_section").value == "moe"
    assert (at.query_params["b"], at.query_params["section"], at.query_params["mode"]) == ("nano-a", "moe", "runs")


# ------------------------------------------------------------------------------------ the model runs only when needed
def test_options_without_the_model_never_rerun_it(app_env, runs, monkeypatch):
    """The sequence-length slider redraws the density figures; the forward and the importance ablations
    run once per (run, text), the latter only when asked."""
    from analysis.metrics import importance

    calls = {"trace": 0, "importance": 0}
    real_trace, real_importance = runs_mod.trace_run, importance.sublayer_importance

    def counted_trace(*args, **kwargs):
        calls["trace"] += 1
        return real_trace(*args, **kwargs)

    def counted_importance(*args, **kwargs):
        calls["importance"] += 1
        return real_importance(*args, **kwargs)

    monkeypatch.setattr(runs_mod, "trace_run", counted_trace)
    monkeypatch.setattr(page_scaffold, "sublayer_importance", counted_importance)
    app_env(runs["good"])
    at = make_app(max_tokens=44)  # a token count no other test uses: nothing cached yet
    at.run()
    open_page(at, "density")
    assert not at.exception and errors(at) == []
    assert calls == {"trace": 1, "importance": 0}
    button = next(b for b in at.button if b.label == "Measure layer importance")
    button.click().run()
    assert not at.exception and errors(at) == []
    assert calls == {"trace": 1, "importance": 1}
    assert "Measure layer importance" not in [b.label for b in at.button]  # its card goes once it has run
    titles = lambda: [c.proto.spec for c in at.get("plotly_chart")]  # noqa: E731
    before = titles()
    at.select_slider(key="k3lab_seq_len").set_value(4096).run()
    assert not at.exception and errors(at) == []
    assert calls == {"trace": 1, "importance": 1}
    assert titles() != before and any("4K" in t for t in titles())
    open_page(at, "attnres")
    open_page(at, "density")
    assert calls == {"trace": 1, "importance": 1}


def test_model_use_lets_forwards_share_and_hooks_wait():
    import threading

    model = torch.nn.Linear(2, 2)
    order: list[str] = []
    inside = threading.Event()
    release = threading.Event()

    def reader(name: str) -> None:
        with model_use(model):
            order.append(f"{name} in")
            inside.set()
            release.wait(5)
            order.append(f"{name} out")

    def writer() -> None:
        with model_use(model, exclusive=True):
            order.append("hooks")

    first = threading.Thread(target=reader, args=("a",))
    first.start()
    assert inside.wait(5)
    with model_use(model):  # a second forward does not wait for the first
        order.append("b in")

    def late_reader() -> None:
        with model_use(model):
            order.append("c in")

    hooks = threading.Thread(target=writer)
    hooks.start()
    hooks.join(0.2)
    assert hooks.is_alive()  # the hook-installing job waits for the running forward
    late = threading.Thread(target=late_reader)
    late.start()
    late.join(0.2)
    assert late.is_alive()  # a new forward queues behind the waiting job (no starvation)
    release.set()
    for thread in (first, hooks, late):
        thread.join(5)
    assert order == ["a in", "b in", "a out", "hooks", "c in"]


# ------------------------------------------------------------------------------------ download all
def test_download_all_is_the_report_folder_zipped(app_env, runs, tmp_path):
    import io
    import zipfile

    from app.render import download_all
    from k3lab import report

    ref = run_list.RunRef("nano-a", str(runs["good"]), "preloaded")
    choice = inputs.TextChoice(inputs.TEXT_MQAR, 32)

    class Bar:  # what st.progress shows, step by step
        texts: list[str] = []

        def progress(self, value: float, text: str) -> None:
            self.texts.append(text)

    steps = download_all.StepCount(Bar(), download_all.report_steps([ref], skip_model_views=True))
    data = download_all.report_zip([ref], choice, static=False, skip_model_views=True, progress=steps)
    assert Bar.texts[0] == f"step 1 of {steps.total}" and Bar.texts[-1] == f"step {steps.total} of {steps.total}"
    out = tmp_path / "cli"
    assert report.main([str(runs["good"]), "--out", str(out), "--sample", "mqar", "--max-tokens", "32",
                        "--no-static", "--skip-model-views", "--quiet"]) == 0  # fmt: skip
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        names = sorted(zf.namelist())
        cli = sorted(f"report/{p.relative_to(out).as_posix()}" for p in out.rglob("*") if p.is_file())
        assert names == cli and "report/report.html" in names and "report/headline.json" in names
        assert json.loads(zf.read("report/headline.json")) == json.loads((out / "headline.json").read_text())
        table = next(n for n in names if n.endswith("density_allocation.csv"))
        assert zf.read(table) == (out / table.removeprefix("report/")).read_bytes()

    app_env(runs["good"])
    at = make_app(max_tokens=32)
    at.session_state["k3lab_text_source"] = inputs.TEXT_MQAR
    at.session_state["k3lab_all_static"] = False
    at.session_state["k3lab_all_skip"] = True
    at.run()
    next(b for b in at.button if b.label == "Prepare the report zip").click().run()
    assert not at.exception and errors(at) == []
    assert [b.label for b in at.get("download_button") if b.key == "k3lab_all_download"]


def test_a_long_input_asks_before_running_the_model(app_env, runs, monkeypatch):

    calls = []
    real_trace = runs_mod.trace_run
    monkeypatch.setattr(runs_mod, "trace_run", lambda *a, **k: calls.append(1) or real_trace(*a, **k))
    app_env(runs["good"])
    n = inputs.LONG_INPUT_TOKENS + 52
    at = make_app(max_tokens=n)
    at.run()
    open_page(at, "attnres")
    assert not at.exception and errors(at) == []
    assert any(f"will read {n:,} tokens" in w.value for w in at.warning), [w.value for w in at.warning]
    assert charts(at) == 0 and calls == []  # nothing ran yet
    next(b for b in at.button if b.label == f"Run on {n:,} tokens").click().run()
    assert not at.exception and errors(at) == []
    assert charts(at) >= 2 and calls == [1]
    assert any(f"· {n:,} tokens of" in c.value for c in at.caption)


def test_two_sessions_trace_one_shared_model_at_the_same_time(runs):
    """No global lock: two threads trace the same cached model on two texts at once, each gets its own trace."""
    import threading

    ref = run_list.RunRef("nano-a", str(runs["good"]), "preloaded")
    choices = [inputs.TextChoice(inputs.TEXT_REPEAT, 38), inputs.TextChoice(inputs.TEXT_MQAR, 36)]
    run = caching.load_run(ref)
    expected = [runs_mod.trace_run(run, caching.make_tokens(c, run)).trace["token_nll"] for c in choices]
    start = threading.Barrier(2)
    results: dict[int, object] = {}

    def session(i: int) -> None:
        start.wait(5)
        results[i] = caching.load(ref, choices[i])

    threads = [threading.Thread(target=session, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(results) == [0, 1]
    for i in range(2):
        got = results[i].ctx.trace["token_nll"]
        assert got.shape == expected[i].shape and np.allclose(got, expected[i], atol=1e-6, equal_nan=True)


def test_prefetch_builds_in_the_background_only_while_no_page_is_drawn(runs):
    import threading

    import pandas as pd
    import plotly.graph_objects as go

    from analysis.views.view import View
    from app.render import prefetch

    loaded = caching.load(
        run_list.RunRef("nano-a", str(runs["good"]), "preloaded"), inputs.TextChoice(inputs.TEXT_MQAR, 34)
    )
    built = threading.Event()
    calls = []

    def build(ctx):
        calls.append(ctx.label)
        built.set()
        return go.Figure(), pd.DataFrame({"n": [len(ctx.input_ids[0])]})

    view = View("prefetch_probe", "probe", "attnres", build)
    with prefetch.script_run():  # a page is being drawn: the background build waits
        prefetch.prefetch([view], loaded)
        assert not built.wait(0.3) and calls == []
    assert built.wait(10) and calls == ["nano-a"]
    fig, df = view_cache.build_view(view, loaded)  # the page then finds it in the cache
    assert calls == ["nano-a"] and df["n"].tolist() == [34]
    prefetch.prefetch([view], loaded)  # once per run key
    assert calls == ["nano-a"]


def test_compare_offers_the_weights_section_for_loaded_runs(app_env, runs):
    """The Weights section on Compare: the weight views of two loaded runs side by side (summaries from the
    models' parameters), the views that need what a loaded nano lacks said in a note."""
    from analysis.views.catalogue import section_views

    app_env(runs["good"], runs["other"])
    at = make_app()
    at.query_params.update({"b": "nano-b", "section": "weights", "mode": "runs"})
    at.session_state["k3lab_show_all_cmp_weights"] = True  # the views past the first three, on request
    for view in section_views("weights"):  # and every A - B expander opened (its chart is built when open)
        at.session_state[f"k3lab_diff_{view.key}"] = True
    at.run()
    open_page(at, "compare")
    assert not at.exception and errors(at) == []
    assert at.radio(key="k3lab_cmp_section").value == "weights"
    assert at.query_params["section"] == "weights"
    weights_views = section_views("weights")
    notes = [i.value for i in at.info]
    not_applicable = [v for v in weights_views if any(i.startswith(f"**{v.title}**") for i in notes)]
    assert {v.key for v in not_applicable} == {"attnres_scale_bias", "weights_expert_norms"}  # AttnRes; not read
    assert charts(at) == len(weights_views) - len(not_applicable) + len(at.expander)


def test_mechanism_pages_open_with_their_measured_views_and_draw_the_rest_on_request(app_env, runs):
    """Degradation (every view measured on the text): all drawn at once, no toggle. LatentMoE: its measured views at
    once, the weights-only router bias behind a toggle that names it and stays on for the session."""
    app_env(runs["good"])
    at = make_app().run()

    def accounted(shown: list) -> int:  # each view is a chart or a "does not apply" note naming it
        notes = sum(1 for i in at.info if any(f"**{v.title}**" in i.value for v in shown))
        return len(at.get("plotly_chart")) + notes

    open_page(at, "degradation")
    assert not at.exception and errors(at) == []
    views = section_views("degradation")
    assert accounted(views) == len(views) and not [t for t in at.toggle if t.key.startswith("k3lab_show_all")]

    open_page(at, "moe")
    assert not at.exception and errors(at) == []
    views = section_views("moe")
    measured, derived = page_scaffold.measured_first(views)
    assert measured and derived and all(v.from_weights or v.from_config for v in derived)
    first = [c.proto.spec for c in at.get("plotly_chart")]
    assert accounted(measured) == len(measured)
    for key in ("moe_coactivation", "moe_latent_pca"):  # one layer at a time: one selector, no "all" beside a dropdown
        box = at.selectbox(key=f"k3lab_pick_{key}_layer")
        assert box.options and not any("all" in o for o in box.options) and box.value == 1, (key, box.options)
    assert any("all" in o for o in at.selectbox(key="k3lab_pick_moe_load_heatmap_layer").options)
    toggle = at.toggle(key="k3lab_show_all_moe_toggle")
    assert toggle.value is False and all(v.title in toggle.help for v in derived)
    toggle.set_value(True).run()
    assert not at.exception and errors(at) == []
    every = [c.proto.spec for c in at.get("plotly_chart")]
    assert every[: len(first)] == first and accounted(views) == len(views)
    open_page(at, "attnres")
    open_page(at, "moe")
    assert len(at.get("plotly_chart")) == len(every)  # still on after a visit elsewhere


def test_the_untrained_twin_toggle_draws_each_view_beside_the_twins(app_env, runs):
    app_env(runs["good"])
    at = make_app().run()
    open_page(at, "degradation")
    alone = charts(at)
    at.toggle(key="k3lab_twin_degradation").set_value(True).run()
    assert not at.exception and errors(at) == []
    titles = [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]
    assert titles and all("(untrained twin)" in t for t in titles), titles[:3]
    assert charts(at) >= alone - len([i for i in at.info])
    open_page(at, "attnres")  # the choice is kept for the session
    assert at.toggle(key="k3lab_twin_attnres").value is True and not at.exception


def test_compares_default_b_is_not_a_quantised_copy_of_a():
    samples = Path(__file__).resolve().parents[2] / "sample_checkpoints"
    a, copy, other = (run_list.RunRef(n, str(samples / n), "sample") for n in ("k3-full", "k3-mxfp4", "plain-moe"))
    assert quantised_copy(a.path, copy.path) and quantised_copy(copy.path, a.path)
    assert not quantised_copy(a.path, other.path) and not quantised_copy(a.path, a.path)
    assert run_list.default_run_b(a, [copy, other]) == other
    assert run_list.default_run_b(a, [copy]) == copy  # nothing else: the copy is still comparable


def test_metrics_are_read_once_per_file_version_and_digested_once(tmp_path, monkeypatch):
    """caching.run_metrics hands out one shared dict until metrics.json changes (no copy per call), and
    metrics_digest hashes a dict once: Training history asked for both on every rerun."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / runs_mod.METRICS_NAME).write_text(json.dumps({"history": [{"step": 1, "loss": 2.5}]}))
    ref = run_list.RunRef("r", str(folder), "path")
    first = caching.run_metrics(ref)
    assert first is caching.run_metrics(ref) and first["history"][0]["loss"] == 2.5

    dumps = []
    monkeypatch.setattr(
        caching.json, "dumps", lambda *a, **k: dumps.append(1) or json.JSONEncoder(sort_keys=True).encode(a[0])
    )
    digest = caching.metrics_digest(first)
    assert caching.metrics_digest(first) == digest and len(dumps) == 1
    assert caching.metrics_digest({"history": [{"step": 1, "loss": 2.5}]}) == digest  # an equal dict: the same digest

    stat = (folder / runs_mod.METRICS_NAME).stat()
    (folder / runs_mod.METRICS_NAME).write_text(json.dumps({"history": [{"step": 1, "loss": 9.0}]}))
    os.utime(folder / runs_mod.METRICS_NAME, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    changed = caching.run_metrics(ref)
    assert changed is not first and changed["history"][0]["loss"] == 9.0
    assert caching.metrics_digest(changed) != digest
