"""The Experiment page's figures drawn right: depth order, numeric key positions."""

from __future__ import annotations

import pandas as pd

from analysis.experiments.layer_attribution import layer_attribution
from analysis.figures.experiment import layer_attribution_figure, mla_attention_figure
from tests.conftest import nano_model, random_ids


def test_layer_attribution_bars_stand_in_depth_order():
    model = nano_model()
    result = layer_attribution(model, random_ids(6, 1, 1)[0], random_ids(1, 1, 2)[0], n_steps=4)
    fig = layer_attribution_figure(result)
    order = list(fig.layout.xaxis.categoryarray)
    layers = [int(c.split()[0][1:]) for c in order]
    assert layers == sorted(layers) and set(order) == {x for trace in fig.data for x in trace.x}
    assert fig.layout.xaxis.categoryorder == "array"


def test_mla_attention_keys_are_numbers_in_position_order():
    rows = pd.DataFrame({"key": ["0", "105", "112", "12", "2"], "prob": [0.1, 0.2, 0.3, 0.25, 0.15]})
    fig = mla_attention_figure(rows, 112, "MLA layer 3, head 0")
    assert list(fig.data[0].x) == [0, 2, 12, 105, 112]
    assert list(fig.data[0].y) == [0.1, 0.15, 0.25, 0.2, 0.3]
    assert fig.layout.xaxis.type == "linear"


def test_the_config_table_numbers_layers_from_zero_like_the_layer_map():
    from analysis.weights.checkpoint_summary import config_summary
    from k3core.modeling.presets import from_preset

    cfg = from_preset("k3-nano")
    summary = config_summary(cfg)
    assert summary["mla_layers"] == [i for i, t in enumerate(cfg.layer_types()) if t == "MLA"]
    assert not any("1-based" in key for key in summary)


def test_the_experiment_views_build_on_the_samples_and_equal_the_analysis_functions():
    import numpy as np
    import pytest

    from analysis.experiments import effects, patching
    from analysis.figures import experiment as fx
    from analysis.metrics import lens
    from analysis.views.view import NotApplicable
    from app.state.inputs import check_options
    from benchmarks.figure_check import sample_contexts
    from k3core.interp.interventions import edit_from_dict, intervene

    views = {view.key: view for view in fx.VIEWS}
    for name, ctx in sample_contexts(("k3-full", "plain-residual"), tokens=24).items():
        # without an experiment's inputs (the report, a Compare section) the views say why, they do not guess one
        for key in ("experiment_loss_change", "experiment_patching", "experiment_attribution"):
            with pytest.raises(NotApplicable, match=r"no .+ chosen \(the view option '\w+' is unset"):
                views[key].build(ctx)
        model, ids = ctx.model, ctx.input_ids[:1]
        edits = [{"kind": "value", "point": "mixer_out", "op": "scale", "layers": [0], "value": 0.5}]
        options = {"edits": edits}
        check_options(options)  # the app's option check knows the experiment's inputs
        _, table = views["experiment_loss_change"].build(ctx.with_options(**options))
        direct = effects.run_experiment(model, ids, [edit_from_dict(d) for d in edits]).effects(ids)
        np.testing.assert_allclose(table.loss_change, direct.loss_change, atol=1e-6)
        assert np.abs(table.loss_change).max() > 1e-4, name  # the edit does something
        metric = {"kind": "span_loss", "start": 3, "stop": 24}
        spec = fx.patching_spec(2, 32, metric, ["resid", "mixer_out"])
        _, df = views["experiment_patching"].build(ctx.with_options(patching=spec))
        corrupted = ids.clone()
        corrupted[0, 2] = 32
        want = patching.activation_patching(
            model, ids, corrupted, patching.Metric(**metric), sites=["resid", "mixer_out"]
        )
        np.testing.assert_allclose(df.fraction_restored, want.fraction_restored, atol=1e-6)
        target = [int(t) for t in ids[0, 8:10]]
        aspec = fx.attribution_spec(8, target)
        _, atable = views["experiment_attribution"].build(ctx.with_options(attribution=aspec))
        from analysis.experiments import attribution

        wanted = attribution.token_attribution(model, ids[0, :8], ids[0, 8:10], tokenizer=ctx.tokenizer).table()
        np.testing.assert_allclose(atable.attribution, wanted.attribution, atol=1e-6)
        fig, ltable = views["experiment_lens"].build(ctx.with_options(edits=edits, lens_value="kl_to_final"))
        with intervene(model, [edit_from_dict(d) for d in edits]):
            labels, logits = lens.lens_logits(model, ids)
        np.testing.assert_allclose(ltable.kl_to_final, lens.lens_table(labels, logits, ids).kl_to_final, atol=1e-6)
        assert "(edited)" in fig.layout.title.text and "KL" in fig.layout.title.text


def test_the_copy_task_marks_where_its_second_half_starts_in_the_per_token_views():
    from analysis.figures import experiment as fx
    from analysis.runs.loading import run_from_model, trace_run
    from analysis.runs.texts import sample_input
    from analysis.views.catalogue import all_views

    run = run_from_model(nano_model())
    repeat = trace_run(run, sample_input("repeat", run.config, 32), label="copy")
    plain = trace_run(run, sample_input("shakespeare", run.config, 32), label="plain")
    assert repeat.repeat_start == 16 and plain.repeat_start is None
    views = {v.key: v for v in all_views()}

    def marks(fig) -> list[float]:
        return [sh.x0 for sh in fig.layout.shapes if sh.type == "line" and sh.line.dash == "dash"]

    for key in ("degradation_entropy_position", "kda_state_norm"):
        fig, _ = views[key].build(repeat)
        assert marks(fig), key
        assert any("second half" in (a.text or "") for a in fig.layout.annotations), key
        assert not marks(views[key].build(plain)[0]), key
    edits = [{"kind": "value", "point": "mixer_out", "op": "scale", "layers": [0], "value": 0.5}]
    fig, table = views["experiment_loss_change"].build(repeat.with_options(edits=edits))
    assert marks(fig) == [table.position.tolist().index(16) - 0.5]
    assert not marks(fx.loss_change_figure(table))
