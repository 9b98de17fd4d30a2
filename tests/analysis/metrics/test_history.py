"""Training history from metrics.json (analysis.metrics.history): the native layout, other layouts and aliases."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.metrics import history as hist

METRICS = {
    "history": [
        {
            "step": 0,
            "tokens": 0,
            "loss": 5.5,
            "moe": {"maxvio": [1.0, 2.0], "cv": [0.5, 0.7]},
            "attnres": {"embedding_weight": [0.5, 0.4]},
        },
        {
            "step": 10,
            "tokens": 4096,
            "loss": 3.0,
            "moe": {"maxvio": [0.5, 1.0], "cv": [0.2, 0.4]},
            "attnres": {"embedding_weight": [0.3, 0.2]},
        },
        {
            "step": 20,
            "tokens": 8192,
            "loss": 2.5,
            "moe": {"maxvio": [0.2, 0.4], "cv": [0.1, 0.3]},
            "attnres": {"embedding_weight": [0.2, 0.2]},
        },
    ],
    "eval": [{"step": 10, "val_bpb": 3.2, "mqar_acc": 0.1}, {"step": 20, "val_bpb": 2.9, "mqar_acc": 0.4}],
    "tokens_seen": 8192,
}


def test_history_long_and_final_numbers():
    long = hist.history_long(METRICS)
    assert set(long["metric"]) >= {"loss", "moe.maxvio", "moe.cv", "attnres.embedding_weight", "val_bpb"}
    maxvio = long[long["metric"] == "moe.maxvio"]
    assert list(maxvio["index"].unique()) == [0.0, 1.0]
    final = hist.final_numbers(METRICS)
    assert final["final_loss"] == 2.5 and final["final_val_bpb"] == 2.9 and final["best_val_bpb"] == 2.9
    assert final["final_mqar_acc"] == 0.4 and final["tokens_seen"] == 8192 and final["last_step"] == 20


NATIVE = {  # the layout k3core.training writes (format "k3lab-metrics", version 1), abridged
    "format": "k3lab-metrics",
    "version": 1,
    "status": "finished",
    "step": 4,
    "seed": 0,
    "data": {"unigram_baseline_bpb": 4.8},
    "history": {
        "train": [
            {"step": 2, "tokens": 256, "loss": 5.5, "bpb": 7.9, "lr": 1e-3},
            {"step": 4, "tokens": 512, "loss": 5.0, "bpb": 7.2, "lr": 1e-3},
        ],
        "val": [{"step": 4, "tokens": 512, "val_loss": 4.9, "val_bpb": 7.1, "mqar_accuracy": 0.25}],
        "moe": [
            {
                "step": 2,
                "layers": {
                    "1": {"load": [3, 1], "max_vio": 0.5, "cv": 0.5, "bias": [0.0, 0.1]},
                    "2": {"load": [2, 2], "max_vio": 0.0, "cv": 0.0, "bias": [0.0, 0.0]},
                },
            }
        ],
        "attnres": [
            {
                "step": 4,
                "mode": "block_attnres",
                "sites": {
                    "1.attn": {"query_norm": 0.5, "mean_weights": [0.75, 0.25], "sources": ["embedding", "block 1"]},
                    "output": {"query_norm": 0.1, "mean_weights": [0.5, 0.5], "sources": ["embedding", "block 1"]},
                },
            }
        ],
    },
    "final": {"step": 4, "tokens_seen": 512, "val_loss": 4.9, "val_bpb": 7.1, "mqar_accuracy": 0.25},
}


def test_history_reads_the_native_training_metrics():
    curves = hist.curves_table(NATIVE, "r")
    by_curve = {c: list(g["value"]) for c, g in curves.groupby("curve")}
    assert by_curve == {
        "train loss": [5.5, 5.0],
        "train bits/byte": [7.9, 7.2],
        "val bits/byte": [7.1],
        "val loss": [4.9],
        "MQAR accuracy": [0.25],
    }
    assert list(curves["tokens"].dropna().unique()) == [256.0, 512.0]
    moe = hist.moe_balance_table(NATIVE, "r")
    maxvio = moe[moe["stat"] == "MaxVio"].set_index("index")["value"]
    assert maxvio.to_dict() == {1.0: 0.5, 2.0: 0.0}
    ar = hist.attnres_history_table(NATIVE, "r").set_index(["site", "metric"])["value"]
    assert ar[("1.attn", "embedding_weight")] == 0.75 and ar[("output", "query_norm")] == 0.1
    p = np.array([0.75, 0.25])
    assert ar[("1.attn", "mix_entropy")] == pytest.approx(-(p * np.log(p)).sum() / np.log(2))
    final = hist.final_numbers(NATIVE)
    assert final["val_bpb"] == 7.1 and final["final_loss"] == 5.0 and final["unigram_baseline_bpb"] == 4.8
    assert final["tokens_seen"] == 512 and "seed" not in final and "version" not in final


def test_history_accepts_columns_lists_and_aliases():
    cols = {"step": [1, 2], "train/loss": [4.0, 3.0], "val_bits_per_byte": [4.5, 3.5]}
    curves = hist.curves_table(cols, "r")
    assert set(curves["curve"]) == {"train loss", "val bits/byte"}
    as_list = hist.curves_table([{"step": 1, "loss": 2.0}], "r")
    assert list(as_list["value"]) == [2.0]
    layered = hist.moe_balance_table({"history": [{"step": 5, "maxvio": {"1": 0.5, "3": 0.9}}]})
    assert sorted(layered["index"]) == [1.0, 3.0]
    assert hist.history_long(None).empty and hist.history_long({"unrelated": "x"}).empty
    assert hist.final_numbers({"history": "not a list"}) == {}
