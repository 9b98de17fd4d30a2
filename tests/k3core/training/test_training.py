"""k3core.training: a real k3-nano model trained for a few steps on CPU (one thread, short sequences)."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch

from k3core import training as T
from k3core.data import IGNORE_INDEX
from k3core.modeling.model import K3ForCausalLM
from k3core.training import rundir
from k3core.utils import files as files_mod
from k3lab import train as train_cli

TINY = dict(
    model="k3-nano",
    steps=8,
    batch_size=4,
    seq_len=32,
    lr=1e-2,
    warmup_steps=2,
    eval_every=4,
    eval_windows=4,
    eval_batch_size=4,
    mqar_fraction=0.25,
    mqar_kv_pairs=4,
    mqar_eval_examples=4,
    log_every=1,
    save_every=3,
    sample_tokens=16,
    threads=1,
    progress=False,
    seed=7,
)


def tiny(tmp: Path, name: str, **changes) -> T.TrainConfig:
    return T.TrainConfig(**{**TINY, "out_dir": str(tmp / name), **changes})


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return K3ForCausalLM.from_pretrained(run_dir).state_dict()


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> Path:
    """An uninterrupted 8-step run (validation at step 4, checkpoints at 3 and 6)."""
    return T.train(tiny(tmp_path_factory.mktemp("ref"), "ref"))


# ------------------------------------------------------------------------------------------ pure helpers
def test_lr_schedule_hand_computed():
    cfg = T.TrainConfig(lr=1e-3, warmup_steps=10, steps=110, min_lr_ratio=0.1)
    assert T.lr_at(0, cfg) == pytest.approx(1e-4)  # (0 + 1) / 10 of the peak
    assert T.lr_at(9, cfg) == pytest.approx(1e-3)
    assert T.lr_at(10, cfg) == pytest.approx(1e-3)  # cosine starts at the peak
    assert T.lr_at(60, cfg) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # halfway: cos(pi/2) = 0
    assert T.lr_at(110, cfg) == pytest.approx(1e-4)  # the floor lr * min_lr_ratio


def test_parse_overrides():
    got = T.parse_overrides(
        [
            "residual=plain",
            "routed_expert_hidden_size=null",
            "full_attn_layers=[4, 8]",
            "num_experts=8",
            "latent_moe_use_norm=None",
        ]
    )
    assert got == {
        "residual": "plain",
        "routed_expert_hidden_size": None,
        "full_attn_layers": [4, 8],
        "num_experts": 8,
        "latent_moe_use_norm": None,
    }
    with pytest.raises(T.TrainError, match="not a K3Config field"):
        T.parse_overrides(["hidden=3"])
    with pytest.raises(T.TrainError, match="key=value"):
        T.parse_overrides(["residual"])
    cfg = T.resolve_model_config("k3-nano", {"residual": "plain"})
    assert cfg.residual == "plain" and cfg.hidden_size == 64
    with pytest.raises(T.TrainError, match="bad --set"):
        T.resolve_model_config("k3-nano", {"residual": "sideways"})


def test_config_validation():
    with pytest.raises(T.TrainError, match="steps"):
        T.TrainConfig(steps=-1)
    with pytest.raises(T.TrainError, match="mqar_fraction"):
        T.TrainConfig(mqar_fraction=1.5)
    with pytest.raises(T.TrainError, match="unknown training options"):
        T.TrainConfig.from_dict({"stpes": 3})
    with pytest.raises(T.TrainError, match="too short for MQAR with 8 pairs and 250 queries"):
        T.TrainConfig(mqar_fraction=0.1, mqar_queries=250)
    with pytest.raises(T.TrainError, match="mqar_loss_weight"):
        T.TrainConfig(mqar_loss_weight=0.0)


def test_mqar_curriculum_grows_pairs_linearly_to_the_target():
    cfg = T.TrainConfig(mqar_kv_pairs=8, mqar_kv_pairs_start=2, mqar_curriculum_steps=600)
    assert [cfg.mqar_pairs_at(s) for s in (0, 99, 100, 300, 599, 600, 10_000)] == [2, 2, 3, 5, 7, 8, 8]
    assert T.TrainConfig(mqar_kv_pairs=8).mqar_pairs_at(0) == 8
    with pytest.raises(T.TrainError, match="mqar_kv_pairs_start"):
        T.TrainConfig(mqar_kv_pairs=8, mqar_kv_pairs_start=9)


def test_mqar_span_curriculum_grows_packed_examples_to_the_row_with_the_pairs():
    cfg = T.TrainConfig(
        seq_len=256, mqar_kv_pairs=8, mqar_kv_pairs_start=4, mqar_curriculum_steps=600, mqar_span_start=64
    )
    assert [cfg.mqar_span_at(s) for s in (0, 299, 300, 599, 600, 10_000)] == [64, 159, 160, 255, 256, 256]
    assert [cfg.mqar_pairs_at(s) for s in (0, 300, 600)] == [4, 6, 8]
    assert T.TrainConfig(seq_len=256, mqar_curriculum_steps=600).mqar_span_at(0) == 256
    with pytest.raises(T.TrainError, match="needs a curriculum"):
        T.TrainConfig(mqar_span_start=64)
    with pytest.raises(T.TrainError, match=r"mqar_span_start must be in \[9, seq_len=256\]"):
        T.TrainConfig(seq_len=256, mqar_curriculum_steps=10, mqar_kv_pairs_start=4, mqar_span_start=8)
    with pytest.raises(T.TrainError, match="mqar_span_start"):
        T.TrainConfig(seq_len=256, mqar_curriculum_steps=10, mqar_span_start=300)


def test_span_curriculum_run_trains_on_packed_rows_and_records_it(tmp_path):
    from k3core.training.loop import Trainer

    cfg = tiny(tmp_path, "span", steps=3, eval_every=0, mqar_fraction=0.5, mqar_queries=8)
    cfg = T.TrainConfig(**{**cfg.to_dict(), "mqar_curriculum_steps": 2, "mqar_kv_pairs_start": 2})
    cfg = T.TrainConfig(**{**cfg.to_dict(), "mqar_span_start": cfg.seq_len // 4})
    trainer = Trainer(T.TrainConfig(**{**cfg.to_dict(), "out_dir": str(tmp_path / "span-batches")}))
    trainer.setup(None)
    x, y, rows = trainer._batch()
    answers = (y[-rows:] != IGNORE_INDEX).nonzero()[:, 1]
    span = cfg.seq_len // 4
    assert rows == cfg.batch_size // 2 and int(answers.max()) >= span  # answers in later segments too
    assert bool((x[-rows:, span : span + 4 : 2] >= 128).all())  # the second segment opens with its own pairs
    run = T.train(cfg)
    assert T.load_metrics(run)["train_config"]["mqar_span_start"] == cfg.seq_len // 4


def test_weighted_recall_loss_is_the_weighted_mean_of_token_losses():
    from k3core.data import IGNORE_INDEX
    from k3core.training.loop import weighted_recall_loss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g)
    targets = torch.randint(0, 11, (3, 5), generator=g)
    targets[2, :3] = IGNORE_INDEX  # the MQAR row scores only its answers
    nll = -torch.log_softmax(logits, -1).gather(-1, targets.clamp_min(0)[..., None])[..., 0]
    text, answers = nll[:2].flatten(), nll[2, 3:]
    want = (text.sum() + 4.0 * answers.sum()) / (text.numel() + 4.0 * answers.numel())
    assert float(weighted_recall_loss(logits, targets, 1, 4.0)) == pytest.approx(float(want), rel=1e-6)
    plain = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    assert float(weighted_recall_loss(logits, targets, 1, 1.0)) == pytest.approx(float(plain), rel=1e-6)


def test_compile_option_trains_through_torch_compile(tmp_path, monkeypatch):
    """--compile routes the training forward (not validation) through torch.compile. Compiling takes minutes on a
    CPU, so this checks the wiring with a pass-through compile; benchmarks/bench_compile.py compares the real
    compiled step with the eager one (loss within 1e-4 over five steps, speed, payback)."""
    compiled = []

    def pass_through(module, **kwargs):
        compiled.append(module)
        return module

    monkeypatch.setattr(torch, "compile", pass_through)
    run = T.train(tiny(tmp_path, "compiled", steps=2, eval_every=0, compile=True))
    assert len(compiled) == 1 and isinstance(compiled[0], K3ForCausalLM)
    assert T.load_metrics(run)["train_config"]["compile"] is True
    compiled.clear()
    T.train(tiny(tmp_path, "eager", steps=2, eval_every=0))
    assert compiled == []


def test_compile_after_runs_the_first_steps_eager_then_the_compiled_forward(tmp_path, monkeypatch):
    """--compile-after N: steps 0..N-1 call the eager model, every later training step the compiled one (counted
    through a pass-through compile); the option needs --compile."""
    calls = []

    def counting_compile(module, **kwargs):
        def compiled_forward(*args, **kw):
            calls.append(1)
            return module(*args, **kw)

        return compiled_forward

    monkeypatch.setattr(torch, "compile", counting_compile)
    run = T.train(tiny(tmp_path, "late", steps=5, eval_every=0, compile=True, compile_after=2))
    assert len(calls) == 3
    assert T.load_metrics(run)["train_config"]["compile_after"] == 2
    with pytest.raises(T.TrainError, match="needs compile"):
        tiny(tmp_path, "x", compile_after=2)


def test_rerun_start_retraces_a_finished_run_bit_for_bit_and_names_what_differs(tmp_path):
    """rerun_start trains a run's recorded config again for its first steps and compares every logged entry
    exactly (timings aside): [] for today's code on the run it trained; a changed record is named; compiled steps
    are refused (they round differently from the eager rerun)."""
    run = T.train(tiny(tmp_path, "finished", steps=6, eval_every=0, mqar_queries=8, mqar_loss_weight=2.0))
    assert T.rerun_start(run, tmp_path / "again", steps=4) == []
    metrics = T.load_metrics(run)
    entry = metrics["history"]["train"][2]  # step 3 (logged every step)
    trained, entry["loss"] = entry["loss"], entry["loss"] + 1e-7  # a record off by about one rounding
    (run / T.METRICS_NAME).write_text(json.dumps(metrics))
    assert T.rerun_start(run, tmp_path / "third", steps=4) == [
        f"step 3: loss {entry['loss']!r} recorded, {trained!r} now"
    ]
    # a run trained elsewhere is compared within a relative tolerance: this one-rounding difference passes it
    assert T.rerun_start(run, tmp_path / "tolerant", steps=4, rtol=1e-5) == []
    entry["loss"] = trained * (1 + 1e-3)
    (run / T.METRICS_NAME).write_text(json.dumps(metrics))
    assert len(T.rerun_start(run, tmp_path / "beyond", steps=4, rtol=1e-5)) == 1
    with pytest.raises(ValueError, match="rtol"):
        T.rerun_start(run, tmp_path / "bad", steps=4, rtol=-1.0)
    metrics["train_config"].update(compile=True, compile_after=2)
    (run / T.METRICS_NAME).write_text(json.dumps(metrics))
    with pytest.raises(T.TrainError, match="compile_after 2"):
        T.rerun_start(run, tmp_path / "fourth", steps=4)


def test_dense_weighted_recall_trains_and_is_recorded(tmp_path):
    run = T.train(tiny(tmp_path, "dense", steps=3, eval_every=0, mqar_queries=20, mqar_loss_weight=5.0))
    m = T.load_metrics(run)
    assert m["train_config"]["mqar_queries"] == 20 and m["train_config"]["mqar_loss_weight"] == 5.0
    assert math.isfinite(m["final"]["val_bpb"])


# ------------------------------------------------------------------------------------------ training
def test_loss_goes_down(reference_run):
    m = T.load_metrics(reference_run)
    losses = [e["loss"] for e in m["history"]["train"]]
    assert len(losses) == 8
    assert losses[-1] < losses[0] - 1.0, losses  # from ~ln 256 = 5.5 nats towards byte statistics
    val = [v["val_bpb"] for v in m["history"]["val"]]
    assert val[1] < val[0], val


def test_interrupted_runs_resume_to_the_same_weights(tmp_path, reference_run):
    ref = weights(reference_run)
    ref_losses = [e["loss"] for e in T.load_metrics(reference_run)["history"]["train"]]

    # 1) a planned stop after step 3, then --resume
    cfg = tiny(tmp_path, "stopped", stop_at=3)
    run = T.train(cfg)
    assert T.load_metrics(run)["status"] == "stopped"
    assert T.latest_state_dir(run).name == "step-0000003"
    T.train({"out_dir": str(run)}, resume=True)
    assert_same_weights(weights(run), ref)
    assert [e["loss"] for e in T.load_metrics(run)["history"]["train"]] == ref_losses

    # 2) Ctrl-C (KeyboardInterrupt) at step 5, after the checkpoint of step 3: saved at 5, resumed
    def interrupt(step, info):
        if step == 5:
            raise KeyboardInterrupt

    run2 = T.train(tiny(tmp_path, "ctrl-c"), callback=interrupt)
    metrics = T.load_metrics(run2)
    assert metrics["status"] == "interrupted" and metrics["step"] == 5
    assert T.latest_state_dir(run2).name == "step-0000005"
    T.train({"out_dir": str(run2)}, resume=True)
    assert_same_weights(weights(run2), ref)
    final = T.load_metrics(run2)
    assert final["status"] == "finished"
    assert [e["step"] for e in final["history"]["val"]] == [4, 8]
    assert final["final"]["val_loss"] == T.load_metrics(reference_run)["final"]["val_loss"]
    assert not (run2 / T.STATE_DIR).exists()  # resume state dropped once finished


def test_sigint_saves_and_stops_at_a_step_boundary(tmp_path):
    before = signal.getsignal(signal.SIGINT)

    def ctrl_c(step, info):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, delivered to the trainer's handler

    run = T.train(tiny(tmp_path, "sigint", eval_every=0, save_every=0), callback=ctrl_c)
    m = T.load_metrics(run)
    assert m["status"] == "interrupted" and m["step"] == 2
    assert T.latest_state_dir(run).name == "step-0000002"
    assert signal.getsignal(signal.SIGINT) is before  # the handler is put back


def test_resume_refuses_to_change_the_schedule(tmp_path):
    run = T.train(tiny(tmp_path, "r", stop_at=1, eval_every=0))
    with pytest.raises(T.TrainError, match="cannot change 'lr'"):
        T.train({"out_dir": str(run), "lr": 1.0}, resume=True)
    with pytest.raises(T.TrainError, match="already holds a run"):
        T.train(tiny(tmp_path, "r"))
    with pytest.raises(T.TrainError, match="no resume checkpoint"):
        T.train({"out_dir": str(tmp_path / "nothing")}, resume=True)


def test_metrics_json_has_the_promised_fields(reference_run):
    m = T.load_metrics(reference_run)
    assert m["format"] == "k3lab-metrics" and m["status"] == "finished" and m["step"] == 8
    assert m["seed"] == 7 and m["code_version"] and m["torch_version"] == torch.__version__
    assert m["params"]["total"] > m["params"]["active"] > 0
    assert m["data"]["unigram_baseline_bpb"] == pytest.approx(4.82, abs=0.05)  # default val plays
    assert len(m["eval"]["window_starts"]) == 4
    train_entry = m["history"]["train"][-1]
    assert {"step", "tokens", "wall_time", "lr", "loss", "bpb", "grad_norm", "tokens_per_s"} <= train_entry.keys()
    assert train_entry["tokens"] == 8 * 4 * 32
    val = m["history"]["val"]
    assert [v["step"] for v in val] == [4, 8]
    assert all(0 <= v["mqar_accuracy"] <= 1 and v["val_bpb"] == pytest.approx(v["val_loss"] / math.log(2)) for v in val)
    moe = m["history"]["moe"]
    assert [e["step"] for e in moe] == list(range(1, 9))
    layer = moe[-1]["layers"]["1"]  # k3-nano: layer 0 dense, layers 1..3 MoE
    assert set(moe[-1]["layers"]) == {"1", "2", "3"}
    assert sum(layer["load"]) == 4 * 32 * 2  # every token routed to top-2 of 8 experts, one step
    assert layer["max_vio"] >= 0 and layer["cv"] >= 0 and len(layer["bias"]) == 8
    attn = m["history"]["attnres"]
    assert [e["step"] for e in attn] == [4, 8] and attn[0]["mode"] == "block_attnres"
    sites = attn[-1]["sites"]
    assert "output" in sites and "1.attn" in sites
    for site in sites.values():
        assert len(site["mean_weights"]) == len(site["sources"])
        assert sum(site["mean_weights"]) == pytest.approx(1.0, abs=1e-4)
        assert site["query_norm"] > 0  # the pseudo-queries moved off their zero init
    assert m["final"]["val_bpb"] == val[-1]["val_bpb"] and m["final"]["tokens_seen"] == 8 * 4 * 32
    assert isinstance(m["sample"]["text"], str) and m["sample"]["max_new_tokens"] == 16
    card = (reference_run / "README.md").read_text()
    assert "unigram baseline" in card and "MQAR" in card and f"{m['params']['total']:,}" in card


def test_recorded_validation_reproduces_from_the_checkpoint(reference_run):
    m = T.load_metrics(reference_run)
    model = K3ForCausalLM.from_pretrained(reference_run)
    corpus = T.load_corpus(T.TrainConfig(**m["train_config"]))
    loss, bpb = T.evaluate_bits_per_byte(model, corpus.val, m["eval"]["window_starts"], m["eval"]["seq_len"])
    assert loss == pytest.approx(m["final"]["val_loss"], rel=1e-5)
    mq = m["eval"]["mqar"]
    acc = T.evaluate_mqar(model, mq["examples"], mq["seq_len"], mq["num_kv_pairs"], seed=mq["seed"])
    assert acc == pytest.approx(m["final"]["mqar_accuracy"])


def test_zero_steps_saves_the_seeds_initialisation_validated(tmp_path):
    run = T.train(tiny(tmp_path, "untrained", steps=0))
    m = T.load_metrics(run)
    assert m["status"] == "finished" and m["history"]["train"] == []
    assert m["final"]["step"] == 0 and m["final"]["tokens_seen"] == 0
    # random bytes: far worse than the unigram baseline a trained run beats
    assert m["final"]["val_bpb"] > m["data"]["unigram_baseline_bpb"] + 1
    assert "untrained" in (run / "README.md").read_text()
    # the very weights the 8-step run with this seed starts training from
    trainer = T.Trainer(tiny(tmp_path, "start"))
    trainer.setup(None)
    assert_same_weights(weights(run), trainer.model.state_dict())
    assert_same_weights(weights(run), T.initial_model(trainer.model_config, TINY["seed"]).state_dict())
    # a run no longer than the check reruns whole: its weights and final validation are compared too
    assert T.rerun_start(run, tmp_path / "again", steps=50) == []
    model = K3ForCausalLM.from_pretrained(run)
    with torch.no_grad():
        model.model.norm.weight[0] += 1e-3
    model.save_pretrained(run)
    validated, m["final"]["val_bpb"] = m["final"]["val_bpb"], m["final"]["val_bpb"] + 1e-9
    (run / T.METRICS_NAME).write_text(json.dumps(m))
    assert T.rerun_start(run, tmp_path / "third", steps=50) == [
        f"final val_bpb {m['final']['val_bpb']!r} recorded, {validated!r} now",
        "weights: model.norm.weight differs",
    ]


def test_balancing_modes(tmp_path):
    aux = T.load_metrics(T.train(tiny(tmp_path, "aux", steps=2, eval_every=0, overrides={"balancing": "aux_loss"})))
    assert all(e["aux_loss"] > 0 for e in aux["history"]["train"])
    assert all(b == 0 for b in aux["history"]["moe"][-1]["layers"]["1"]["bias"])  # biases untouched
    sign = T.load_metrics(T.train(tiny(tmp_path, "sign", steps=2, eval_every=0)))
    assert "aux_loss" not in sign["history"]["train"][0]
    bias = sign["history"]["moe"][-1]["layers"]["1"]["bias"]
    # two sign steps of u = 1e-3: every bias is -2e-3, 0 or 2e-3 (+-1e-3 after a tie), not all 0
    assert max(abs(b) for b in bias) > 0
    assert all(min(abs(b - u * 1e-3) for u in (-2, -1, 0, 1, 2)) < 1e-6 for b in bias)


# ------------------------------------------------------------------------------------------ checkpoints
def test_checkpoint_writes_are_atomic(tmp_path, monkeypatch, reference_run):
    run = T.train(tiny(tmp_path, "atomic", stop_at=2))
    state = run / T.STATE_DIR
    assert [p.name for p in state.iterdir()] == ["step-0000002"]
    assert not [p for p in run.rglob("*") if ".tmp" in p.name]

    real = files_mod.atomic_write_bytes

    def disk_full(path, data):
        if path.name == "optimizer.safetensors":
            real(path, data[: len(data) // 2])  # half a file lands in the temporary folder...
            raise OSError("No space left on device")  # ...then the write fails
        real(path, data)

    monkeypatch.setattr(rundir, "atomic_write_bytes", disk_full)
    with pytest.raises(OSError, match="No space"):
        T.train({"out_dir": str(run), "stop_at": 4}, resume=True)
    assert [p.name for p in state.iterdir()] == ["step-0000002"]  # the last good checkpoint is intact
    assert not [p for p in run.rglob("*") if ".tmp" in p.name]
    monkeypatch.setattr(rundir, "atomic_write_bytes", real)
    T.train({"out_dir": str(run)}, resume=True)
    assert_same_weights(weights(run), weights(reference_run))


def test_no_pickle_in_the_resume_state(tmp_path):
    run = T.train(tiny(tmp_path, "p", stop_at=1, eval_every=0))
    files = sorted(p.name for p in T.latest_state_dir(run).iterdir())
    assert files == ["config.json", "model.safetensors", "optimizer.safetensors", "state.json"]
    from safetensors.torch import load_file

    opt = load_file(str(T.latest_state_dir(run) / "optimizer.safetensors"))
    assert "rng/data" in opt and "lm_head.weight/exp_avg" in opt and "lm_head.weight/exp_avg_sq" in opt
    state = json.loads((T.latest_state_dir(run) / "state.json").read_text())
    assert state["step"] == 1 and state["train_config"]["seed"] == 7


# ------------------------------------------------------------------------------------------ CLI
def test_cli(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        train_cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--resume" in out and "--set" in out and "--mqar-fraction" in out

    assert train_cli.main(["k3-nano", "--set", "residual=sideways", "--out", str(tmp_path / "bad")]) == 2
    assert "residual" in capsys.readouterr().err

    out_dir = tmp_path / "cli"
    args = [
        "k3-nano",
        "--set",
        "residual=scale_bias",
        "--steps",
        "2",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--eval-windows",
        "2",
        "--mqar-eval-examples",
        "2",
        "--sample-tokens",
        "4",
        "--threads",
        "1",
        "--no-progress",
        "--out",
        str(out_dir),
    ]
    assert train_cli.main(args + ["--stop-at", "1"]) == 0
    assert "--resume" in capsys.readouterr().out
    assert train_cli.main(["--resume", str(out_dir), "--threads", "1"]) == 0
    m = T.load_metrics(out_dir)
    assert m["status"] == "finished" and m["model_config"]["residual"] == "scale_bias"
    assert m["history"]["attnres"][-1]["mode"] == "scale_bias"
    assert set(m["history"]["attnres"][-1]["layers"]["0"]) == {
        "attn_scale_mean",
        "attn_bias_mean",
        "mlp_scale_mean",
        "mlp_bias_mean",
    }
    assert train_cli.main(["--resume", str(out_dir)]) == 2  # finished: nothing to resume
    assert "already finished" in capsys.readouterr().err
