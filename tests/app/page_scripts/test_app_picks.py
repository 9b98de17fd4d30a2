"""Layer and head pickers in the app (app.state.pickers) with AppTest on real k3-nano checkpoints: a link's pick reopens
the view on that layer and head, a changed pick goes into the link, bad picks warn and the page keeps running, and
Compare draws one pick for both runs."""

from __future__ import annotations

import base64
import json

import numpy as np

from app.render import cards
from app.state.links import picks_from_param, picks_param
from k3core.modeling.presets import from_preset
from tests.app.apptest_helpers import errors, make_app, open_page, table_with

CONFIG = from_preset("k3-nano")
MLA = CONFIG.layer_types().index("MLA")
KDA = CONFIG.layer_types().index("KDA")
HEAD = CONFIG.num_attention_heads - 1
VIEW = "degradation_entropy_position"


def _values(v) -> np.ndarray:
    """A chart's numbers: a list, or plotly's typed array ({"dtype", "bdata"}) of the screen copy."""
    if isinstance(v, dict):
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=v["dtype"]).astype(float)
    return np.asarray(v, dtype=float)


def _figures(at) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def _figure_titled(at, words: str) -> dict:
    found = [f for f in _figures(at) if words in f["layout"]["title"]["text"]]
    assert len(found) == 1, [f["layout"]["title"]["text"] for f in _figures(at)]
    return found[0]


def _data(fig: dict) -> list[dict]:
    """A drawn figure's data traces, without the null-reference lines beside them (issue 39)."""
    return [t for t in fig["data"] if "null reference" not in t.get("name", "")]


def test_a_link_with_a_pick_reopens_that_layer_and_head(app_env, runs, monkeypatch):
    app_env(runs["good"])
    stems = {}
    card = cards.figure_card

    def spy(fig, df, key, stem, description="", **options):  # the real card, its export file stem noted
        stems[key] = stem
        return card(fig, df, key=key, stem=stem, description=description, **options)

    monkeypatch.setattr(cards, "figure_card", spy)
    at = make_app()
    at.query_params.update({"pick": f"{VIEW}:L{MLA}H{HEAD}"})
    at.run()
    open_page(at, "degradation")
    assert not at.exception and errors(at) == []
    assert at.selectbox(key=f"k3lab_pick_{VIEW}_layer").value == MLA
    assert at.selectbox(key=f"k3lab_pick_{VIEW}_head").value == HEAD
    fig = _figure_titled(at, "entropy by query position")
    assert [t["name"] for t in _data(fig)] == [f"MLA layer {MLA} head {HEAD}"]
    assert at.query_params["pick"] == f"{VIEW}:L{MLA}H{HEAD}"
    assert stems[VIEW] == f"nano-a_{VIEW}_L{MLA}H{HEAD}"  # exports carry the pick
    assert stems["degradation_sink"] == "nano-a_degradation_sink"
    # the other MLA views are drawn for every head (the pick is the view's own)
    assert at.selectbox(key="k3lab_pick_degradation_sink_layer").value == "all"
    assert at.selectbox(key="k3lab_pick_degradation_sink_layer").options == ["all MLA layers", f"MLA layer {MLA}"]

    # a pick made in the page goes into the link; "all" takes it out
    at.selectbox(key=f"k3lab_pick_{VIEW}_head").set_value("all").run()
    assert not at.exception and errors(at) == []
    assert at.query_params["pick"] == f"{VIEW}:L{MLA}"
    at.selectbox(key="k3lab_pick_degradation_sink_layer").set_value(MLA).run()
    assert at.query_params["pick"] == f"{VIEW}:L{MLA},degradation_sink:L{MLA}"
    sink = _figure_titled(at, "Attention sink")
    assert sink["data"][0]["x"] == [f"L{MLA} H{h}" for h in range(CONFIG.num_attention_heads)]
    open_page(at, "attnres")  # kept for the session: a visit elsewhere and back shows the same picks
    open_page(at, "degradation")
    assert at.selectbox(key="k3lab_pick_degradation_sink_layer").value == MLA
    assert at.selectbox(key=f"k3lab_pick_{VIEW}_layer").value == MLA
    at.selectbox(key=f"k3lab_pick_{VIEW}_layer").set_value("all").run()
    at.selectbox(key="k3lab_pick_degradation_sink_layer").set_value("all").run()
    assert "pick" not in at.query_params


def test_bad_picks_in_a_link_warn_and_the_page_keeps_running(app_env, runs):
    app_env(runs["good"])
    at = make_app()
    bad = f"degradation_sink:L{KDA},{VIEW}:H99,nosuch_view:L1,degradation_sink_profile:Lx,moe_coactivation:H1"
    at.query_params.update({"pick": bad})
    at.run()
    notes = " ".join(w.value for w in at.warning).replace("\\", "")  # the link's notes, on the page it opened
    assert "'nosuch_view:L1'" in notes and "'Lx' is not a pick" in notes
    assert "moe_coactivation names head" in notes
    open_page(at, "degradation")
    assert not at.exception and errors(at) == []
    warnings = " ".join(w.value for w in at.warning).replace("\\", "")
    assert f"layer {KDA} is not one of this run's MLA layers: {MLA}" in warnings
    assert "head 99 is not one of this run's MLA heads" in warnings
    # every view still drawn, on all layers and heads
    assert at.selectbox(key="k3lab_pick_degradation_sink_layer").value == "all"
    assert at.selectbox(key=f"k3lab_pick_{VIEW}_head").value == "all"
    assert len(_data(_figure_titled(at, "entropy by query position"))) == 1  # one MLA layer, mean over heads


def test_compare_draws_one_pick_for_both_runs(app_env, runs):
    app_env(runs["good"], runs["other"])
    at = make_app()
    at.query_params.update({"b": "nano-b", "mode": "runs", "section": "degradation", "pick": f"{VIEW}:L{MLA}H{HEAD}"})
    at.run()
    open_page(at, "compare")
    assert not at.exception and errors(at) == []
    assert at.selectbox(key=f"k3lab_pick_{VIEW}_head").value == HEAD
    fig = _figure_titled(at, f"Entropy by query position, MLA layer {MLA}, head {HEAD}: nano-a vs nano-b")
    assert [t["name"] for t in _data(fig)] == [f"MLA layer {MLA} head {HEAD}"] * 2
    assert any("One pick for both runs." in c.value for c in at.caption)
    # each half is that run's own head: the two runs' weights differ, so their curves do
    a, b = (_values(t["y"]) for t in _data(fig))
    assert a.shape == b.shape and not np.allclose(a, b)


def test_link_pick_values_round_trip():
    picks = {VIEW: {"layer": 3, "head": 1}, "moe_coactivation": {"layer": 2}}
    value = picks_param(picks)
    assert value == f"{VIEW}:L3H1,moe_coactivation:L2"  # views in key order: one link per state
    assert picks_from_param(value) == (picks, [])
    assert picks_param({}) is None


def test_experiment_token_pickers_show_that_layer_and_head_from_the_trace(app_env, runs):
    """The Token section's KDA and MLA tables use the same pickers: a link's pick reopens the KDA gates of that
    layer and head, equal to the trace's values at the token."""
    from analysis.runs.texts import sample_input
    from k3core.interp.recorder import record
    from k3core.interp.trace import names
    from k3core.modeling.model import K3ForCausalLM

    app_env(runs["good"])
    at = make_app(24)
    at.query_params.update({"pick": f"token_kda:L{KDA + 1}H1"})
    at.run()
    open_page(at, "experiment")
    at.radio(key="k3lab_exp_section").set_value("Token").run()
    at.selectbox(key="k3lab_tok_pos").set_value(6).run()
    assert not at.exception and errors(at) == []
    assert at.selectbox(key="k3lab_pick_token_kda_layer").value == KDA + 1
    assert at.selectbox(key="k3lab_pick_token_mla_layer").value == MLA  # no "all": one layer's attention row
    assert at.selectbox(key="k3lab_pick_token_mla_layer").options == [f"MLA layer {MLA}"]
    model = K3ForCausalLM.from_pretrained(runs["good"]).eval()
    ids = sample_input("shakespeare", model.config, 24).input_ids
    with record(model, what="kda") as trace:
        model(ids)
    gates = table_with(at, "beta")
    assert list(zip(gates["layer"], gates["head"])) == [(KDA + 1, 1)]
    assert gates.beta.iloc[0] == np.float32(trace[names.kda_beta(KDA + 1)][0, 6, 1])
    at.selectbox(key="k3lab_pick_token_kda_head").set_value("all").run()
    assert list(table_with(at, "beta")["head"]) == list(range(CONFIG.kda_num_heads))
    assert at.query_params["pick"] == f"token_kda:L{KDA + 1}"
    moe = [i for i in range(CONFIG.num_hidden_layers) if CONFIG.is_moe_layer(i)]
    assert sorted(set(table_with(at, "expert")["layer"])) == moe  # all MoE layers until one is picked
    at.selectbox(key="k3lab_pick_token_moe_layer").set_value(moe[-1]).run()
    assert not at.exception and errors(at) == []
    experts = table_with(at, "expert")
    with record(model, what="moe") as routed:
        model(ids)
    assert list(experts["layer"]) == [moe[-1]] * CONFIG.num_experts_per_token
    assert list(experts["expert"]) == routed[names.moe_experts(moe[-1])][0, 6].tolist()
