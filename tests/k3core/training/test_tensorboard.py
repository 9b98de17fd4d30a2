"""k3lab train's TensorBoard events, read back with tensorboard's own reader (EventAccumulator)."""

from __future__ import annotations

import json
import math

import pytest

from k3core import training as T
from k3core.training.tensorboard import dead_share

from .test_training import tiny

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _scalars(run_dir) -> dict[str, dict[int, float]]:
    acc = event_accumulator.EventAccumulator(str(run_dir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_train_writes_tensorboard_events_matching_metrics(tmp_path):
    """A run's events hold every logged quantity at the steps and values metrics.json records."""
    run = T.train(tiny(tmp_path, "tb", steps=6, eval_every=3))
    history = json.loads((run / "metrics.json").read_text())["history"]
    sc = _scalars(run)

    train = history["train"]
    assert [e["step"] for e in train] == sorted(sc["train/loss"])
    for e in train:
        for key, tag in (("loss", "loss"), ("bpb", "bits_per_byte"), ("lr", "lr"), ("tokens_per_s", "tokens_per_s")):
            assert sc[f"train/{tag}"][e["step"]] == pytest.approx(e[key], rel=1e-6)
        step_time = sc["train/step_time_s"][e["step"]]
        assert step_time > 0 and e["tokens_per_s"] * step_time == pytest.approx(4 * 32, rel=1e-4)

    val = history["val"]
    assert len(val) >= 2
    for e in val:
        assert sc["val/bits_per_byte"][e["step"]] == pytest.approx(e["val_bpb"], rel=1e-6)
        assert sc["val/mqar_accuracy"][e["step"]] == pytest.approx(e["mqar_accuracy"], rel=1e-6)

    moe = history["moe"]
    assert moe
    for e in moe:
        for layer, stats in e["layers"].items():
            got = sc[f"moe/layer_{layer}/max_vio"][e["step"]]
            assert got == pytest.approx(stats["max_vio"], rel=1e-6) or (
                math.isnan(got) and math.isnan(stats["max_vio"])
            )
            assert sc[f"moe/layer_{layer}/dead_share"][e["step"]] == pytest.approx(dead_share(stats["load"]))

    attn = history["attnres"]
    assert attn
    for e in attn:
        for site, info in e["sites"].items():
            weights = [sc[f"attnres/{site}/{src}"][e["step"]] for src in info["sources"]]
            assert weights == pytest.approx(info["mean_weights"], abs=1e-6)
            assert sum(weights) == pytest.approx(1.0, abs=1e-4)


def test_resumed_run_continues_the_same_event_log(tmp_path):
    """A run stopped at step 3 and resumed to 6 reads back as one curve: every step once, values as metrics.json."""
    run = T.train(tiny(tmp_path, "resumed", steps=6, eval_every=0, save_every=0, stop_at=3))
    assert sorted(_scalars(run)["train/loss"]) == [1, 2, 3]
    T.train({"out_dir": str(run)}, resume=True)
    history = json.loads((run / "metrics.json").read_text())["history"]["train"]
    losses = _scalars(run)["train/loss"]
    assert sorted(losses) == [e["step"] for e in history] == [1, 2, 3, 4, 5, 6]
    assert [losses[e["step"]] for e in history] == pytest.approx([e["loss"] for e in history], rel=1e-6)


def test_resume_hides_steps_logged_after_the_checkpoint(tmp_path):
    """A run that dies after logging step 3 with its last checkpoint at step 2: the resumed session trains step 3
    again, and the event log reads back as one curve, each step once, with metrics.json's values."""

    def crash(step, info):
        if step == 3:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        T.train(tiny(tmp_path, "crashed", steps=5, eval_every=0, save_every=2), callback=crash)
    run = tmp_path / "crashed"
    assert sorted(_scalars(run)["train/loss"]) == [1, 2, 3]
    T.train({"out_dir": str(run)}, resume=True)
    history = json.loads((run / "metrics.json").read_text())["history"]["train"]
    losses = _scalars(run)["train/loss"]
    assert sorted(losses) == [e["step"] for e in history] == [1, 2, 3, 4, 5]
    assert [losses[e["step"]] for e in history] == pytest.approx([e["loss"] for e in history], rel=1e-6)


def test_dead_share():
    assert dead_share([3, 0, 1, 0]) == 0.5
    assert dead_share([1, 1]) == 0.0
    assert math.isnan(dead_share([]))
