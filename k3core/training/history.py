"""What a run records in metrics.json (``format`` "k3lab-metrics", ``version`` 1)::

    status            "running" | "stopped" (--stop-at) | "interrupted" | "finished";  step (completed steps)
    run_name, command, code_version, torch_version, seed, device, threads, created
    train_config      every TrainConfig field;   model_config   the K3Config dict
    params            {"total", "active"}
    data              {"source", "train_names", "val_names", "train_bytes", "val_bytes", "val_sha256",
                       "unigram_baseline_bpb"}
    eval              {"seq_len", "batch_size", "window_starts", "mqar": {"examples", "num_kv_pairs",
                       "seq_len", "seed"}}     -- exactly what evaluate_bits_per_byte / evaluate_mqar use
    history.train     [{"step", "tokens", "wall_time", "lr", "loss", "bpb", "grad_norm", "tokens_per_s",
                        "aux_loss"?}]                                   one entry per log_every steps
    history.val       [{"step", "tokens", "wall_time", "val_loss", "val_bpb", "mqar_accuracy"}]
    history.moe       [{"step", "layers": {"<layer>": {"load": [count per expert over the interval],
                        "max_vio", "cv", "bias": [e_bias]}}}]           one entry per log_every steps
    history.attnres   [{"step", "mode", "sites": {"<layer>.attn|mlp"|"output": {"query_norm",
                        "mean_weights": [per source], "sources": [names]}}}]       (attnres modes)
                      [{"step", "mode": "scale_bias", "layers": {"<layer>": {"attn_scale_mean",
                        "attn_bias_mean", "mlp_scale_mean", "mlp_bias_mean"}}}]  (scale_bias mode)
                                                                        one entry per validation
    final             {"step", "tokens_seen", "wall_time_s", "val_loss", "val_bpb", "mqar_accuracy"}
    sample            {"prompt", "text", "max_new_tokens", "temperature", "top_k", "seed"}

``max_vio`` and ``cv`` are :func:`k3core.training.load_stats.moe_load_stats` of the interval's load.
"""

from __future__ import annotations

import datetime
import hashlib
from typing import Any

import numpy as np
import torch

from ..data import Corpus, unigram_cross_entropy_bits
from ..interp.trace import Trace, TraceNames
from ..modeling.config import ATTNRES_MODES
from .config import TrainConfig
from .evaluate import LN2, MQAR_EVAL_SEED
from .load_stats import moe_load_stats
from .rundir import code_version

HISTORY_KEYS = ("train", "val", "moe", "attnres")


def new_metrics(
    cfg: TrainConfig,
    model: torch.nn.Module,
    corpus: Corpus,
    window_starts: list[int],
    run_name: str,
    command: str | None,
    device: torch.device,
    history: dict[str, list],
) -> dict[str, Any]:
    """The metrics.json of a run at step 0 (schema above)."""
    val = np.ascontiguousarray(corpus.val)
    return {
        "format": "k3lab-metrics",
        "version": 1,
        "status": "running",
        "step": 0,
        "run_name": run_name,
        "command": command,
        "code_version": code_version(),
        "torch_version": torch.__version__,
        "seed": cfg.seed,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "train_config": cfg.to_dict(),
        "model_config": model.config.to_dict(),
        "params": {"total": model.num_parameters(), "active": model.num_parameters(active=True)},
        "data": {
            "source": corpus.source,
            "train_names": list(corpus.train_names),
            "val_names": list(corpus.val_names),
            "train_bytes": int(len(corpus.train)),
            "val_bytes": int(len(corpus.val)),
            "val_sha256": hashlib.sha256(val.tobytes()).hexdigest(),
            "unigram_baseline_bpb": unigram_cross_entropy_bits(corpus.train, corpus.val),
        },
        "eval": {
            "seq_len": cfg.seq_len,
            "batch_size": cfg.eval_batch_size,
            "window_starts": window_starts,
            "mqar": {
                "examples": cfg.mqar_eval_examples,
                "num_kv_pairs": cfg.mqar_kv_pairs,
                "seq_len": cfg.seq_len,
                "seed": MQAR_EVAL_SEED,
            },
        },
        "history": history,
        "final": None,
        "sample": None,
    }


def moe_entry(model: torch.nn.Module, loads: dict[int, torch.Tensor], step: int) -> dict[str, Any]:
    """One history.moe entry: per MoE layer, the load counted since the last entry, its MaxVio/CV, e_bias."""
    layers = {}
    for layer in model.model.layers:
        if layer.is_moe:
            load = loads[layer.layer_idx]
            bias = layer.block_sparse_moe.gate.e_score_correction_bias
            layers[str(layer.layer_idx)] = {
                "load": load.tolist(),
                **moe_load_stats(load),
                "bias": [round(float(b), 6) for b in bias],
            }
    return {"step": step, "layers": layers}


@torch.no_grad()
def attnres_entry(model: torch.nn.Module, trace: Trace | None, step: int) -> dict[str, Any] | None:
    """One history.attnres entry: per-site pseudo-query norm and mean depth weights (from a trace of a
    validation batch), or the scale/bias means in scale_bias mode; None for the plain residual."""
    mode = model.config.residual
    if mode == "scale_bias":
        layers = {}
        for i, layer in enumerate(model.model.layers):
            layers[str(i)] = {
                "attn_scale_mean": float(layer.self_attention_res_scale.mean()),
                "attn_bias_mean": float(layer.self_attention_res_bias.mean()),
                "mlp_scale_mean": float(layer.mlp_res_scale.mean()),
                "mlp_bias_mean": float(layer.mlp_res_bias.mean()),
            }
        return {"step": step, "mode": mode, "layers": layers}
    if mode not in ATTNRES_MODES or trace is None:
        return None
    sites = {}
    for site, sources in trace.meta.get(TraceNames.ATTNRES_SOURCES_META, {}).items():
        p = trace.get(TraceNames.attnres(site))
        qn = trace.get(TraceNames.attnres_query_norm(site))
        if p is None:
            continue
        sites[site] = {
            "query_norm": None if qn is None else float(qn),
            "mean_weights": [round(float(v), 6) for v in p.reshape(-1, p.shape[-1]).mean(0)],
            "sources": list(sources),
        }
    return {"step": step, "mode": mode, "sites": sites}


def train_entry(
    cfg: TrainConfig, step: int, wall_time: float, info: dict[str, Any], interval: dict[str, float], seconds: float
) -> dict[str, Any]:
    """One history.train entry: the mean loss of the ``interval["n"]`` steps since the last entry
    (``loss = interval["loss"] / n``, ``bpb = loss / ln 2``), the last step's lr / grad norm / aux loss,
    and the interval's throughput ``interval["tokens"] / seconds``."""
    loss = interval["loss"] / interval["n"]
    entry = {
        "step": step,
        "tokens": step * cfg.batch_size * cfg.seq_len,
        "wall_time": wall_time,
        "lr": info["lr"],
        "loss": loss,
        "bpb": loss / LN2,
        "grad_norm": info["grad_norm"],
        "tokens_per_s": interval["tokens"] / seconds,
    }
    if info["aux_loss"] is not None:
        entry["aux_loss"] = info["aux_loss"]
    return entry


def sample_entry(cfg: TrainConfig, text: str) -> dict[str, Any]:
    """metrics.json ``sample``: the model card's generated text and how it was drawn."""
    return {
        "prompt": cfg.sample_prompt,
        "text": text,
        "max_new_tokens": cfg.sample_tokens,
        "temperature": cfg.sample_temperature,
        "top_k": cfg.sample_top_k,
        "seed": cfg.seed,
    }


def final_entry(cfg: TrainConfig, step: int, wall_time: float, last_val: dict[str, Any]) -> dict[str, Any]:
    """metrics.json ``final``: the last validation entry's numbers at the last step."""
    return {
        "step": step,
        "tokens_seen": step * cfg.batch_size * cfg.seq_len,
        "wall_time_s": wall_time,
        "val_loss": last_val["val_loss"],
        "val_bpb": last_val["val_bpb"],
        "mqar_accuracy": last_val["mqar_accuracy"],
    }
