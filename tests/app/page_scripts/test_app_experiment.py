"""The Experiment page and Compare's baseline-vs-edited mode, headless (AppTest) on a real k3-nano."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from streamlit.proto.Metric_pb2 import Metric

from app.state import links
from k3core.interp.edit_kinds import MoEEdit
from tests.app.apptest_helpers import errors, make_app, open_page, save_nano, table_with


@pytest.fixture(scope="module")
def nano_run(tmp_path_factory):
    return save_nano(tmp_path_factory.mktemp("runs") / "nano-a", 0)


def _ready(app_env, nano_run):
    app_env(nano_run)
    at = make_app(24)
    at.run()
    return open_page(at, "experiment")


def test_build_an_edit_from_the_menus_and_run_it(app_env, nano_run):
    at = _ready(app_env, nano_run)
    assert not at.exception and errors(at) == []
    at.selectbox(key="k3lab_exp_kind").set_value("moe").run()
    at.selectbox(key="k3lab_exp_layer_moe").set_value(2)
    at.selectbox(key="k3lab_exp_op_moe").set_value("ban")
    at.multiselect(key="k3lab_exp_experts").set_value([0, 1, 2])
    at.button(key="FormSubmitter:k3lab_exp_form_moe-Add edit").click().run()
    assert not at.exception and errors(at) == []
    assert at.session_state[links.EDITS] == [MoEEdit("ban", layer=2, experts=[0, 1, 2]).to_dict()]
    in_link = at.query_params["edits"]
    in_link = in_link[0] if isinstance(in_link, list) else in_link
    assert json.loads(in_link) == at.session_state[links.EDITS]
    at.button(key="k3lab_exp_run").click().run()
    assert not at.exception and errors(at) == []
    metrics = {m.label: m.value for m in at.metric}
    assert {"Mean loss, baseline", "Mean loss, edited"} <= set(metrics)
    # worse = warm: a loss increase is drawn red (inverse delta colours), never a green up-arrow
    [edited] = [m for m in at.metric if m.label == "Mean loss, edited"]
    direction = Metric.MetricDirection.Name(edited.proto.direction)
    want = {"UP": "RED", "DOWN": "GREEN", "NONE": "GRAY"}[direction]
    assert Metric.MetricColor.Name(edited.proto.color) == want, (edited.proto.delta, direction)
    table = table_with(at, "loss_change")
    assert len(table) == 23 and np.allclose(table.loss_change, table.edited_loss - table.base_loss)
    assert table.loss_change.abs().max() > 0
    # Compare: baseline vs edited, on the same run and text
    at.session_state["k3lab_cmp_mode"] = links.EDITED
    at.session_state["k3lab_cmp_section"] = "moe"
    open_page(at, "compare")
    assert not at.exception and errors(at) == []
    assert any("**B** = edited" in c.value for c in at.caption)
    assert len(at.get("plotly_chart")) >= 2


def test_a_bad_edit_shows_an_error_and_a_link_restores_the_edits(app_env, nano_run):
    at = _ready(app_env, nano_run)
    at.selectbox(key="k3lab_exp_kind").set_value("moe").run()
    at.selectbox(key="k3lab_exp_op_moe").set_value("force")
    at.multiselect(key="k3lab_exp_experts").set_value([0, 1, 2, 3])  # more than k = 2
    at.button(key="FormSubmitter:k3lab_exp_form_moe-Add edit").click().run()
    assert not at.exception
    assert any("at most k = 2" in e for e in errors(at)) and not at.session_state[links.EDITS]
    values, notes = links.from_params(
        {"edits": json.dumps([{"kind": "moe", "op": "ban", "layer": 1, "experts": [3]}])}, []
    )
    assert values[links.EDITS] == [MoEEdit("ban", layer=1, experts=[3]).to_dict()] and not notes
    values, notes = links.from_params({"edits": "[{'kind': 1}"}, [])
    assert links.EDITS not in values and "could not be read" in notes[0]


def test_patching_attribution_and_token_tabs(app_env, nano_run):
    at = _ready(app_env, nano_run)
    at.radio(key="k3lab_exp_section").set_value("Patching").run()
    at.button(key="FormSubmitter:k3lab_patch_form-Run patching").click().run()
    assert not at.exception and errors(at) == []
    df = table_with(at, "fraction_restored")
    assert abs(df[(df.layer == 3) & (df.site == "resid")].fraction_restored.iloc[0] - 1) < 1e-6
    at.radio(key="k3lab_exp_section").set_value("Attribution").run()
    at.number_input(key="k3lab_attr_n").set_value(5)
    at.number_input(key="k3lab_attr_m").set_value(2)
    at.button(key="FormSubmitter:k3lab_attr_form-Run attribution").click().run()
    assert not at.exception and errors(at) == []
    at.radio(key="k3lab_exp_section").set_value("Lens").run()
    assert not at.exception and errors(at) == []
    lens_rows = table_with(at, "kl_to_final")
    assert len(lens_rows) == 3 and lens_rows.kl_to_final.iloc[-1] == pytest.approx(0, abs=1e-6)  # block AttnRes
    # one readable column of top predictions, every number shown to 4 significant digits
    assert "top predictions" in lens_rows and "top_probs" not in lens_rows
    assert all(len(p.split(" · ")) == 5 for p in lens_rows["top predictions"])
    floats = lens_rows.select_dtypes("float").to_numpy().ravel()
    assert all(float(f"{v:.4g}") == v for v in floats if v == v)
    at.radio(key="k3lab_exp_section").set_value("Token").run()
    assert at.selectbox(key="k3lab_tok_pos").value == 22  # opens on the last token with a next one, not token 0
    assert all(len(p.split(".")[-1]) == 4 for p in table_with(at, "prob")["prob"])  # probabilities to 4 decimals
    at.selectbox(key="k3lab_tok_pos").set_value(6).run()
    assert not at.exception and errors(at) == []
    experts = table_with(at, "expert")
    from analysis.runs.texts import sample_input
    from k3core.interp.recorder import record
    from k3core.modeling.model import K3ForCausalLM

    model = K3ForCausalLM.from_pretrained(nano_run).eval()
    ids = sample_input("shakespeare", model.config, 24).input_ids
    with torch.no_grad(), record(model, what="moe") as trace:
        logits = model(ids).logits
    for layer in (1, 2, 3):
        assert list(experts[experts.layer == layer].expert) == trace[f"blocks.{layer}.moe.experts"][0, 6].tolist()
    assert list(table_with(at, "prob").token_id) == logits[0, 6].topk(5).indices.tolist()


@pytest.fixture(scope="module")
def nano_chunked(tmp_path_factory):
    """k3-nano with KDA chunks of 8 tokens, so a 24-token text has three chunks (ends 8, 16, 24)."""
    from dataclasses import replace

    from k3core.modeling.model import K3ForCausalLM
    from k3core.modeling.presets import from_preset

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("runs") / "nano-chunked"
    K3ForCausalLM.from_config(replace(from_preset("k3-nano"), kda_chunk_size=8)).save_pretrained(path)
    return path


def test_a_chunk_state_reset_from_the_menus_changes_only_the_tokens_after_the_chunk(app_env, nano_chunked):
    at = _ready(app_env, nano_chunked)
    at.selectbox(key="k3lab_exp_kind").set_value("kda").run()
    layer = at.selectbox(key="k3lab_exp_layer_kda").options[0]
    at.selectbox(key="k3lab_exp_op_kda").set_value("reset_chunk_state").run()  # the fields follow the operation
    chunks = at.multiselect(key="k3lab_exp_chunks")
    assert chunks.options == [f"chunk {n} (ends after token {8 * (n + 1)})" for n in range(3)]
    chunks.set_value([0])
    at.button(key="FormSubmitter:k3lab_exp_form_kda-Add edit").click().run()
    assert not at.exception and errors(at) == []
    [edit] = at.session_state[links.EDITS]
    assert edit["op"] == "reset_chunk_state" and edit["chunks"] == [0] and edit["layer"] == int(layer)
    at.button(key="k3lab_exp_run").click().run()
    assert not at.exception and errors(at) == []
    table = table_with(at, "loss_change").sort_values("position")
    before, after = table[table.position < 8], table[table.position >= 8]
    assert len(before) == 8 and before.loss_change.abs().max() < 1e-6  # those tokens read the state before it
    assert after.loss_change.abs().max() > 1e-4


def test_edits_take_position_ranges_duplicates_are_refused_and_kda_shows_only_its_fields(app_env, nano_run):
    at = _ready(app_env, nano_run)
    at.selectbox(key="k3lab_exp_kind").set_value("kda").run()
    at.selectbox(key="k3lab_exp_op_kda").set_value("gate_off").run()
    labels = {n.label for n in at.number_input}
    assert "Factor" not in labels and "g (<= 0)" not in labels and "Forget the state before position" not in labels
    assert {"Positions from", "Positions to (excluded)"} <= labels
    at.number_input(key="k3lab_exp_from_kda").set_value(4)
    at.number_input(key="k3lab_exp_to_kda").set_value(9)
    at.button(key="FormSubmitter:k3lab_exp_form_kda-Add edit").click().run()
    assert not at.exception and errors(at) == []
    [edit] = at.session_state[links.EDITS]
    assert edit["op"] == "gate_off" and edit["tokens"] == [4, 9]
    # the same edit again (Enter in a number field submits the form, then "Add edit" would add it twice): refused
    at.button(key="FormSubmitter:k3lab_exp_form_kda-Add edit").click().run()
    assert len(at.session_state[links.EDITS]) == 1
    assert any("already in the list" in w.value for w in at.warning)
    at.selectbox(key="k3lab_exp_op_kda").set_value("pin_g").run()
    assert "g (<= 0)" in {n.label for n in at.number_input}
    # an empty range is refused with its reason
    at.number_input(key="k3lab_exp_from_kda").set_value(9)
    at.number_input(key="k3lab_exp_to_kda").set_value(4)
    at.button(key="FormSubmitter:k3lab_exp_form_kda-Add edit").click().run()
    assert any("is empty" in e for e in errors(at)) and len(at.session_state[links.EDITS]) == 1
    # two experiments: the session's history shows both, side by side
    at.button(key="k3lab_exp_run").click().run()
    at.selectbox(key="k3lab_exp_kind").set_value("moe").run()
    at.selectbox(key="k3lab_exp_op_moe").set_value("ban").run()
    at.multiselect(key="k3lab_exp_experts").set_value([0])
    at.button(key="FormSubmitter:k3lab_exp_form_moe-Add edit").click().run()
    at.button(key="k3lab_exp_run").click().run()
    assert not at.exception and errors(at) == []
    history = table_with(at, "top-1 changes")
    assert len(history) == 2 and "kda gate_off" in history.edits.iloc[0] and "moe ban" in history.edits.iloc[1]
    assert history["loss change"].iloc[0] == pytest.approx(
        history["edited loss"].iloc[0] - history["base loss"].iloc[0], abs=1e-5
    )
    assert any(b.label == "Download per-token loss (CSV)" for b in at.get("download_button"))


def test_patching_shows_the_gap_first_reads_tokens_as_text_and_confirms_long_jobs(app_env, nano_run):
    at = _ready(app_env, nano_run)
    at.radio(key="k3lab_exp_section").set_value("Patching").run()
    at.text_input(key="k3lab_patch_text").input("ab")
    at.button(key="FormSubmitter:k3lab_patch_form-Run patching").click().run()
    assert any("must be one token" in e for e in errors(at))
    at.text_input(key="k3lab_patch_text").input("z")
    at.selectbox(key="k3lab_patch_metric").set_value("logit_diff")
    at.text_input(key="k3lab_patch_correct").input("e")
    at.text_input(key="k3lab_patch_wrong").input("e")
    at.button(key="FormSubmitter:k3lab_patch_form-Run patching").click().run()
    assert any("are the same token" in e for e in errors(at))
    at.text_input(key="k3lab_patch_wrong").input("a")
    at.button(key="FormSubmitter:k3lab_patch_form-Run patching").click().run()
    assert not at.exception and errors(at) == []
    metrics = {m.label: m.value for m in at.metric}
    assert "Gap (clean - corrupted)" in metrics
    gap = abs(float(metrics["Gap (clean - corrupted)"]))
    assert any("ratio of noise" in w.value for w in at.warning) == (gap < 0.5)
    assert any("correct 'e' (id 101), wrong 'a' (id 97)" in c.value for c in at.caption)
    assert any("1 by construction" in c.value for c in at.caption)
    # per position over every site: a long job, estimated and not run until confirmed; then every site runs
    at.checkbox(key="k3lab_patch_pp").check()
    at.number_input(key="k3lab_patch_from").set_value(2)
    at.number_input(key="k3lab_patch_to").set_value(8)
    at.button(key="FormSubmitter:k3lab_patch_form-Run patching").click().run()
    assert any("forwards" in w.value and "Tick" in w.value for w in at.warning)
    at.checkbox(key="k3lab_patch_ok").check()
    at.button(key="FormSubmitter:k3lab_patch_form-Run patching").click().run()
    assert not at.exception and errors(at) == []
    df = table_with(at, "fraction_restored")
    assert set(df.site) == {"resid", "mixer_out", "ffn_out", "depth_weights"} and set(df.position) == set(range(2, 8))


def test_attribution_on_moe_shows_plain_and_frozen_ig_with_steps_and_text_targets(app_env, nano_run):
    at = _ready(app_env, nano_run)
    at.radio(key="k3lab_exp_section").set_value("Attribution").run()
    at.number_input(key="k3lab_attr_n").set_value(4)
    at.selectbox(key="k3lab_attr_method").set_value("integrated_gradients")
    at.number_input(key="k3lab_attr_steps").set_value(16)
    at.text_input(key="k3lab_attr_target").input("ab")
    at.button(key="FormSubmitter:k3lab_attr_form-Run attribution").click().run()
    assert not at.exception and errors(at) == []
    captions = " ".join(c.value for c in at.caption)
    assert "integrated_gradients: f(x) - f(baseline)" in captions and "ig_frozen_routing: f(x)" in captions
    assert "expert sets changed" in captions
    assert {b.label for b in at.get("download_button")} >= {
        "Download integrated_gradients (CSV)",
        "Download ig_frozen_routing (CSV)",
    }
