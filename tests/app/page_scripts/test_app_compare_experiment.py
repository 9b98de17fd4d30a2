"""Compare's Experiment section (app.render.compare_experiment) headless (AppTest) on real k3-nano runs: the same
experiment on A and B, its cost shown before anything runs, the figures side by side with exports, and a message
where the edits do not apply to one run."""

from __future__ import annotations

import json

import pytest
import torch

from analysis.experiments import patching
from app.state import links
from k3core.interp.edit_kinds import MoEEdit
from k3core.modeling.model import K3ForCausalLM
from k3core.modeling.presets import from_preset
from tests.app.apptest_helpers import errors, make_app, open_page, save_nano

TOKENS = 16
EDIT = MoEEdit("ban", layer=2, experts=[0, 1]).to_dict()


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    torch.manual_seed(3)
    dense = K3ForCausalLM.from_config(from_preset("k3-nano", num_experts=0)).save_pretrained(root / "nano-dense")
    return {"a": save_nano(root / "nano-a", 0), "b": save_nano(root / "nano-b", 1), "dense": dense}


def _compare(app_env, *folders, run_b: str):
    app_env(*folders)
    at = make_app(TOKENS)
    at.session_state[links.EDITS] = [EDIT]
    at.session_state["k3lab_cmp_mode"] = links.TWO_RUNS
    at.session_state["k3lab_cmp_run_b"] = run_b
    at.session_state["k3lab_cmp_section"] = "experiment"
    at.run()
    return open_page(at, "compare")


def _charts(at) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def test_the_same_experiment_on_two_runs_is_estimated_first_then_drawn_side_by_side(app_env, two_runs):
    at = _compare(app_env, two_runs["a"], two_runs["b"], run_b="nano-b")
    assert not at.exception and errors(at) == []
    assert _charts(at) == []  # nothing ran: the choices come first
    at.checkbox(key="k3lab_cmp_exp_patch").check()
    at.checkbox(key="k3lab_cmp_exp_attr").check()
    at.number_input(key="k3lab_cmp_exp_n").set_value(4)
    at.button(key="FormSubmitter:k3lab_cmp_exp_form-Estimate the cost").click().run()
    assert not at.exception and errors(at) == []
    assert _charts(at) == []  # estimated, not run
    estimate = next(m.value for m in at.markdown if m.value.startswith("This experiment runs")).replace("\\", "")
    config = from_preset("k3-nano")
    # loss change 2 (baseline, edited) + lens 1 + patching (one per layer x site, clean, corrupted) + ablation 4 + 1
    forwards = 2 + 1 + len(patching.patch_plan(config, TOKENS)) + 2 + 4 + 1
    assert estimate.count(f"{forwards:,} forward passes on {TOKENS} tokens") == 2, estimate
    assert "**nano-a**" in estimate and "**nano-b**" in estimate

    at.button(key="k3lab_cmp_exp_run").click().run()
    assert not at.exception and errors(at) == []
    # loss change A | B, patching, token attribution, lens; the loss change's A - B is built when its expander opens
    assert len(_charts(at)) == 4
    assert [e.label for e in at.expander if e.label.startswith("Difference A - B")] == [
        "Difference A - B: Per-token loss change of the edits"
    ]
    at.session_state["k3lab_diff_experiment_loss_change"] = True
    at.run()
    assert not at.exception and errors(at) == []
    specs = _charts(at)
    titles = [s["layout"]["title"]["text"] for s in specs]
    assert len(specs) == 5 and "loss change, nano-a - nano-b" in titles[1], titles
    for spec in specs[:1] + specs[2:]:
        names = {t.get("name", "") for t in spec["data"]} | {a.get("text", "") for a in spec["layout"]["annotations"]}
        assert any("nano-a" in n for n in names) and any("nano-b" in n for n in names), names
    keys = {b.key for b in at.get("download_button")}
    for view in ("experiment_loss_change", "experiment_patching", "experiment_attribution", "experiment_lens"):
        assert f"cmp-{view}-csv" in keys, (view, sorted(keys))
    # rerun: kept, nothing asks again
    at.run()
    assert len(_charts(at)) == 5 and not any(b.key == "k3lab_cmp_exp_run" for b in at.button)


def test_an_edit_that_does_not_apply_to_run_b_says_so_and_draws_run_a_alone(app_env, two_runs):
    at = _compare(app_env, two_runs["a"], two_runs["dense"], run_b="nano-dense")
    at.button(key="FormSubmitter:k3lab_cmp_exp_form-Estimate the cost").click().run()
    assert not at.exception and errors(at) == []
    [warning] = [w for w in (w.value.replace("\\", "") for w in at.warning) if "nano-dense" in w]
    assert "the edits do not apply to this run" in warning
    at.button(key="k3lab_cmp_exp_run").click().run()
    assert not at.exception and errors(at) == []
    assert any("only nano-a" in c.value.replace("\\", "") for c in at.caption)
    titles = [s["layout"]["title"]["text"] for s in _charts(at)]
    assert len(titles) == 2, titles  # A's loss change alone; the lens of both without edits
    assert "(edited)" not in titles[1]


def test_baseline_vs_edited_points_to_the_other_modes(app_env, two_runs):
    app_env(two_runs["a"])
    at = make_app(TOKENS)
    at.session_state[links.EDITS] = [EDIT]
    at.session_state["k3lab_cmp_mode"] = links.EDITED
    at.session_state["k3lab_cmp_section"] = "experiment"
    at.run()
    open_page(at, "compare")
    assert not at.exception and errors(at) == []
    assert any("Baseline vs edited already puts the edits in B" in i.value for i in at.info)
