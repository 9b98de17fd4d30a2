"""Training a K3 config on bytes: the ``k3lab train`` command and the :func:`train` API.

    k3lab train k3-mini --steps 2000 --out runs/mini            # a preset
    k3lab train my_config.json --set residual=plain --out runs/p  # a config.json, with overrides
    k3lab train --resume runs/mini                                # continue an interrupted run

What a step does (``s`` = completed steps so far, ``N`` = ``steps``)::

    x, y  = text windows from the train split (+ MQAR rows, fraction ``mqar_fraction``)
    loss  = CE(model(x), y)                    (+ aux_loss_coef * aux_loss when balancing="aux_loss")
    g     = clip(grad loss, grad_clip)         (global L2 norm)
    theta = AdamW(theta, g, lr(s))             (decay only on >= 2-D weights)
    e_bias updated (model.update_router_biases) when balancing is "sign" or "quantile"

    lr(s) = lr * (s + 1) / W                                              for s < W (warmup)
    lr(s) = lr_min + (lr - lr_min) * (1 + cos(pi * (s - W) / (N - W))) / 2   after; lr_min = lr * min_lr_ratio

A run directory is a loadable checkpoint plus its history::

    config.json, model.safetensors     K3ForCausalLM.from_pretrained(run_dir)
    metrics.json                       history and results (schema below)
    README.md                          model card, written when the run finishes
    train_state/step-000123/           resume state (only while the run is unfinished, or --keep-state):
        model.safetensors, config.json, optimizer.safetensors (AdamW tensors + RNG states),
        state.json (step, scalar optimiser state, training config, history)

Everything is safetensors + JSON: nothing is pickled. A checkpoint is first written to a
``.tmp-*`` folder and then renamed into place, so a crash never leaves a half-written one; it is
written every ``save_every`` steps and on Ctrl-C (SIGINT: finish the current step, save, exit).
Resuming restores the weights, AdamW moments, the LR-schedule position, the data generator and
torch RNG states and the history, so an interrupted run ends with the same weights as an
uninterrupted one with the same seed: bit for bit on CPU with the same thread count and code version
(CUDA kernels such as index_add_ are not deterministic, so GPU runs agree only closely).

metrics.json (``format`` "k3lab-metrics", ``version`` 1)::

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
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import ConfigError, K3Config
from .data import (
    ByteTokenizer,
    Corpus,
    load_shakespeare,
    load_text_path,
    make_mqar,
    mix_mqar,
    mqar_accuracy,
    random_batches,
    unigram_cross_entropy_bits,
)
from .model import K3Cache, K3ForCausalLM

__all__ = [
    "TrainConfig",
    "TrainError",
    "train",
    "main",
    "build_parser",
    "lr_at",
    "parse_overrides",
    "resolve_model_config",
    "eval_window_starts",
    "evaluate_bits_per_byte",
    "evaluate_mqar",
    "load_corpus",
    "generate_text",
    "load_metrics",
    "latest_state_dir",
]

METRICS_NAME = "metrics.json"
STATE_DIR = "train_state"
MQAR_EVAL_SEED = 1234
LN2 = math.log(2.0)

#: TrainConfig fields that may change when resuming: they do not change the weights a run ends with.
RUNTIME_FIELDS = frozenset(
    {
        "out_dir",
        "device",
        "threads",
        "stop_at",
        "keep_state",
        "progress",
        "save_every",
        "log_every",
        "sample_tokens",
        "sample_prompt",
        "sample_temperature",
        "sample_top_k",
    }
)


class TrainError(ValueError):
    """Bad training arguments, or a run directory that cannot be (re)started."""


class _Interrupted(Exception):
    """Internal: a stop request (SIGINT, stop_event) was seen at a step boundary."""


@dataclass
class TrainConfig:
    """Everything that defines a training run (see the module docstring for the update rule)."""

    model: str = "k3-mini"  # preset name, config.json path, or checkpoint folder (its config.json)
    overrides: dict[str, Any] = field(default_factory=dict)  # K3Config fields to change (--set)
    data: str = "shakespeare"  # "shakespeare" or a UTF-8 text file / folder of .txt/.md files
    val_plays: list[str] | None = None  # Shakespeare plays held out (None: data.DEFAULT_VAL_PLAYS)
    out_dir: str = "runs/run"
    steps: int = 1000  # total optimizer steps (the length of the LR schedule)
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping
    eval_every: int = 200  # validate every N steps (and at the end); 0: only at the end
    eval_windows: int = 64  # validation windows of seq_len bytes, evenly spread over the val split
    eval_batch_size: int = 16
    mqar_fraction: float = 0.0  # share of training rows replaced by MQAR sequences
    mqar_kv_pairs: int = 8
    mqar_eval_examples: int = 32
    log_every: int = 10
    save_every: int = 100  # checkpoint every N steps; 0: only on stop/interrupt/end
    seed: int = 0
    device: str = "auto"  # "auto": cuda when available, else cpu
    threads: int | None = None  # torch CPU threads (None: torch's default)
    sample_tokens: int = 400
    sample_prompt: str = "ROMEO:\n"
    sample_temperature: float = 0.8
    sample_top_k: int | None = None
    stop_at: int | None = None  # save and stop after this step, as if interrupted (resume later)
    keep_state: bool = False  # keep train_state/ after the run finishes
    progress: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise TrainError for values no run can use."""
        positive = (
            "steps",
            "batch_size",
            "seq_len",
            "eval_windows",
            "eval_batch_size",
            "mqar_kv_pairs",
            "mqar_eval_examples",
            "log_every",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise TrainError(f"{name} must be a positive integer, got {value!r}")
        for name in ("warmup_steps", "eval_every", "save_every", "sample_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise TrainError(f"{name} must be an integer >= 0, got {value!r}")
        if not self.lr > 0:
            raise TrainError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise TrainError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise TrainError("weight_decay and grad_clip must be >= 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise TrainError(f"betas must be in [0, 1), got ({self.beta1}, {self.beta2})")
        if not 0 <= self.mqar_fraction <= 1:
            raise TrainError(f"mqar_fraction must be in [0, 1], got {self.mqar_fraction}")
        if self.mqar_fraction > 0 and self.seq_len < 3 * self.mqar_kv_pairs:
            raise TrainError(
                f"seq_len={self.seq_len} is too short for MQAR with {self.mqar_kv_pairs} pairs "
                f"(needs >= {3 * self.mqar_kv_pairs})"
            )
        if self.stop_at is not None and not 0 < self.stop_at:
            raise TrainError(f"stop_at must be a positive step number, got {self.stop_at}")
        if self.threads is not None and self.threads < 1:
            raise TrainError(f"threads must be >= 1, got {self.threads}")
        if self.sample_temperature < 0:
            raise TrainError("sample_temperature must be >= 0 (0: greedy)")
        if not isinstance(self.overrides, dict):
            raise TrainError("overrides must be a dict of K3Config fields")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise TrainError(f"unknown training options: {unknown}")
        return cls(**data)


# ------------------------------------------------------------------------------------------ pure helpers
def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for the step after ``step`` completed steps: linear warmup, then cosine decay.

    ``lr * (s + 1) / W`` for ``s < W``; then ``lr_min + (lr - lr_min) * (1 + cos(pi * p)) / 2`` with
    ``p = (s - W) / max(1, N - W)`` clamped to [0, 1] and ``lr_min = lr * min_lr_ratio``.
    """
    warm = cfg.warmup_steps
    if step < warm:
        return cfg.lr * (step + 1) / warm
    lr_min = cfg.lr * cfg.min_lr_ratio
    progress = min(1.0, max(0.0, (step - warm) / max(1, cfg.steps - warm)))
    return lr_min + (cfg.lr - lr_min) * 0.5 * (1.0 + math.cos(math.pi * progress))


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["key=value", ...]`` -> dict. Values are JSON (``8``, ``null``, ``[4, 8]``, ``true``), else strings.

    Keys must be K3Config fields; ``None``/``none`` also mean null.
    """
    fields = {f.name for f in dataclasses.fields(K3Config)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise TrainError(f"--set expects key=value, got {item!r}")
        if key not in fields:
            raise TrainError(f"--set {key}: not a K3Config field (choose from {sorted(fields)})")
        raw = raw.strip()
        if raw in ("None", "none"):
            value: Any = None
        else:
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                value = raw
        out[key] = value
    return out


def resolve_model_config(spec: str, overrides: dict[str, Any] | None = None) -> K3Config:
    """A K3Config from a preset name, a config.json path or a checkpoint folder, with field overrides."""
    from .config import PRESETS

    path = Path(spec)
    if spec in PRESETS:
        cfg = K3Config.from_preset(spec)
    elif path.is_dir() and (path / "config.json").is_file():
        cfg = K3Config.load(path / "config.json")
    elif path.is_file():
        try:
            cfg = K3Config.load(path)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TrainError(f"{path}: not a JSON config ({exc})") from exc
    else:
        raise TrainError(
            f"model {spec!r} is neither a preset ({sorted(PRESETS)}) nor an existing config.json or checkpoint folder"
        )
    if overrides:
        try:
            cfg = K3Config.from_dict({**cfg.to_dict(), **overrides})
        except (ConfigError, TypeError) as exc:
            raise TrainError(f"bad --set override: {exc}") from exc
    return cfg


def load_corpus(cfg: TrainConfig) -> Corpus:
    """The train/val split named by ``cfg.data`` ("shakespeare", or a local text file/folder)."""
    if cfg.data == "shakespeare":
        return load_shakespeare(cfg.val_plays)
    path = Path(cfg.data)
    if not path.exists():
        raise TrainError(f"--data {cfg.data!r}: no such file or folder (use 'shakespeare' or a text path)")
    return load_text_path(path)


def eval_window_starts(n_bytes: int, seq_len: int, n_windows: int) -> list[int]:
    """Start offsets of ``n_windows`` non-overlapping validation windows spread over ``n_bytes``.

    With ``W = (n_bytes - 1) // seq_len`` full windows and ``n = min(n_windows, W)``, window ``j``
    is ``(j * W // n) * seq_len`` (the spreading :func:`k3core.data.eval_batches` uses).
    """
    total = (n_bytes - 1) // seq_len
    if total < 1:
        raise TrainError(f"validation split ({n_bytes} bytes) is shorter than one window of {seq_len + 1}")
    n = min(n_windows, total)
    return [int(j * total // n) * seq_len for j in range(n)]


def _windows(data: np.ndarray, starts: Sequence[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(seq_len + 1)[None, :]
    chunk = torch.from_numpy(np.asarray(data)[idx].astype(np.int64))
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


@torch.no_grad()
def evaluate_bits_per_byte(
    model: K3ForCausalLM,
    data: np.ndarray,
    starts: Sequence[int],
    seq_len: int,
    batch_size: int = 16,
    on_first_batch: Callable[[torch.Tensor], None] | None = None,
) -> tuple[float, float]:
    """Mean next-byte loss over the windows ``data[s : s + seq_len + 1]``: (nats/byte, bits/byte).

    ``loss = sum of token NLLs / number of tokens`` over all windows; ``bits = loss / ln 2``.
    ``on_first_batch(x)`` may wrap the first batch (e.g. to trace it); it must run the forward.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    try:
        for b in range(0, len(starts), batch_size):
            x, y = _windows(data, starts[b : b + batch_size], seq_len)
            x, y = x.to(device), y.to(device)
            out = model(x, targets=y)
            total += float(out.loss) * y.numel()
            count += y.numel()
    finally:
        model.train(was_training)
    if count == 0:
        raise TrainError("no validation windows")
    loss = total / count
    return loss, loss / LN2


@torch.no_grad()
def evaluate_mqar(
    model: K3ForCausalLM,
    examples: int,
    seq_len: int,
    num_kv_pairs: int,
    batch_size: int = 16,
    seed: int = MQAR_EVAL_SEED,
) -> float:
    """MQAR accuracy (argmax at answer positions) on ``examples`` sequences from a fixed seed."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    batch = make_mqar(examples, seq_len, num_kv_pairs, vocab_size=model.config.vocab_size, generator=gen)
    correct, total = 0.0, 0
    try:
        for b in range(0, examples, batch_size):
            x = batch.inputs[b : b + batch_size].to(device)
            t = batch.targets[b : b + batch_size]
            logits = model(x).logits.cpu()
            n = int((t != -100).sum())
            correct += mqar_accuracy(logits, t) * n
            total += n
    finally:
        model.train(was_training)
    return correct / max(total, 1)


@torch.no_grad()
def generate_text(
    model: K3ForCausalLM,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = None,
    seed: int = 0,
) -> str:
    """Sample ``max_new_tokens`` bytes after ``prompt`` (cached decoding; temperature 0 = greedy).

    Each step draws from ``softmax(logits / temperature)`` (restricted to the ``top_k`` largest when
    given) with a generator seeded by ``seed``, so the text is reproducible. Uses ``model.generate``
    (k3core.generate) when available, else an equivalent cached loop.
    """
    tok = ByteTokenizer()
    device = next(model.parameters()).device
    ids = torch.tensor([tok.encode(prompt) or [10]], device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    sample = temperature > 0
    try:
        from .generate import generate
    except ImportError:
        generate = None
    if generate is not None:
        out = generate(
            model,
            ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature if sample else 1.0,
            top_k=top_k,
            do_sample=sample,
            generator=gen,
        )
        return tok.decode(out[0, ids.shape[1] :])
    was_training = model.training
    model.eval()
    out_ids: list[int] = []
    try:
        with torch.no_grad():
            cache = K3Cache.for_config(model.config)
            logits = model(ids, cache=cache).logits[:, -1].float()
            for _ in range(max_new_tokens):
                if not sample:
                    nxt = logits.argmax(-1)
                else:
                    scaled = logits / temperature
                    if top_k is not None and top_k < scaled.shape[-1]:
                        kth = scaled.topk(top_k, dim=-1).values[..., -1:]
                        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
                    nxt = torch.multinomial(torch.softmax(scaled, -1), 1, generator=gen).squeeze(-1)
                out_ids.append(int(nxt))
                logits = model(nxt.view(1, 1), cache=cache).logits[:, -1].float()
    finally:
        model.train(was_training)
    return tok.decode(out_ids)


def code_version() -> str:
    """``git describe --always --dirty`` of the source tree, else the installed package version."""
    root = Path(__file__).resolve().parent.parent
    try:
        res = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--tags"], cwd=root, capture_output=True, text=True, timeout=10
        )
        if res.returncode == 0 and res.stdout.strip():
            return res.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        from importlib.metadata import version

        return f"k3lab {version('k3lab')}"
    except Exception:  # noqa: BLE001 - not installed
        return "unknown"


def derive_seed(seed: int, purpose: str) -> int:
    """An independent 63-bit seed for one purpose: ``sha256(f"{seed}:{purpose}")`` truncated."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{purpose}".encode()).digest()[:8], "little") >> 1


def moe_load_stats(load: torch.Tensor) -> dict[str, float]:
    """Imbalance of per-expert counts: ``max_vio = max/mean - 1``, ``cv = std/mean`` (population std)."""
    x = load.double()
    mean = float(x.mean())
    if mean == 0:
        return {"max_vio": 0.0, "cv": 0.0}
    return {"max_vio": float(x.max()) / mean - 1.0, "cv": float(x.std(unbiased=False)) / mean}


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise TrainError(f"--device {name!r}: {exc}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TrainError("--device cuda requested but CUDA is not available")
    return dev


# ------------------------------------------------------------------------------------------ file IO
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync, then rename over ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_json(path: Path, obj: Any) -> None:
    _atomic_write(path, (json.dumps(obj, indent=1, allow_nan=True) + "\n").encode())


def load_metrics(run_dir: str | Path) -> dict[str, Any]:
    """The metrics.json of a run directory."""
    path = Path(run_dir) / METRICS_NAME
    if not path.is_file():
        raise TrainError(f"{path}: no metrics.json (not a k3lab run directory?)")
    return json.loads(path.read_text())


def latest_state_dir(run_dir: str | Path) -> Path | None:
    """The newest complete resume checkpoint ``train_state/step-*`` (None when there is none)."""
    root = Path(run_dir) / STATE_DIR
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step-*") if (p / "state.json").is_file())
    return done[-1] if done else None


def _optimizer_payload(optimizer: torch.optim.Optimizer, names: list[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """AdamW state as (tensors keyed ``<param>/<key>``, JSON-able scalars and param groups)."""
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for idx, st in sd["state"].items():
        for key, value in st.items():
            if torch.is_tensor(value):
                tensors[f"{names[idx]}/{key}"] = value.detach().to("cpu").contiguous().clone()
            else:
                scalars[f"{names[idx]}/{key}"] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def _restore_optimizer(
    optimizer: torch.optim.Optimizer, names: list[str], tensors: dict[str, torch.Tensor], meta: dict
) -> None:
    index = {n: i for i, n in enumerate(names)}
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        pname, _, sub = key.rpartition("/")
        if pname not in index:
            raise TrainError(f"optimizer state names an unknown parameter {pname!r}")
        state.setdefault(index[pname], {})[sub] = value
    for key, value in meta["scalars"].items():
        pname, _, sub = key.rpartition("/")
        state.setdefault(index[pname], {})[sub] = value
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in meta["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ------------------------------------------------------------------------------------------ the trainer
class Trainer:
    """One training run (fresh or resumed). Use :func:`train`; this class holds the moving parts."""

    def __init__(
        self,
        cfg: TrainConfig,
        callback: Callable[[int, dict], Any] | None = None,
        stop_event: threading.Event | None = None,
        command: str | None = None,
    ):
        self.cfg = cfg
        self.callback = callback
        self.stop_event = stop_event
        self.command = command
        self.run_dir = Path(cfg.out_dir)
        self.device = _resolve_device(cfg.device)
        self._sigint = False

    # -------------------------------------------------------------- set-up
    def setup(self, resume_from: Path | None) -> None:
        cfg = self.cfg
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        self.corpus = load_corpus(cfg)
        if len(self.corpus.train) < cfg.seq_len + 1:
            raise TrainError(f"training split has {len(self.corpus.train)} bytes, need > seq_len={cfg.seq_len}")
        self.starts = eval_window_starts(len(self.corpus.val), cfg.seq_len, cfg.eval_windows)
        if resume_from is None:
            self.model_config = resolve_model_config(cfg.model, cfg.overrides)
            torch.manual_seed(derive_seed(cfg.seed, "init"))
            self.model = K3ForCausalLM.from_config(self.model_config).to(self.device)
        else:
            self.model = K3ForCausalLM.from_pretrained(resume_from).to(self.device)
            self.model_config = self.model.config
        if self.model_config.vocab_size < 256:
            raise TrainError(
                f"byte-level training needs vocab_size >= 256, the config has {self.model_config.vocab_size}"
            )
        self.model.train()
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        # param order in the optimizer must match self.opt_names (decay group first)
        names_by_id = {id(p): n for n, p in self.model.named_parameters()}
        self.opt_names = [names_by_id[id(p)] for p in decay + no_decay]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=lr_at(0, cfg),
            betas=(cfg.beta1, cfg.beta2),
        )
        self.data_gen = torch.Generator().manual_seed(derive_seed(cfg.seed, "data"))
        self.step = 0
        self.wall_prior = 0.0
        self.t_session = time.perf_counter()
        self.history: dict[str, list] = {"train": [], "val": [], "moe": [], "attnres": []}
        self.metrics = self._base_metrics()
        if resume_from is not None:
            self._load_state(resume_from)
        self._moe_acc = self._zero_moe_acc()

    def _base_metrics(self) -> dict[str, Any]:
        cfg, corpus, model = self.cfg, self.corpus, self.model
        val = np.ascontiguousarray(corpus.val)
        return {
            "format": "k3lab-metrics",
            "version": 1,
            "status": "running",
            "step": 0,
            "run_name": self.run_dir.name,
            "command": self.command,
            "code_version": code_version(),
            "torch_version": torch.__version__,
            "seed": cfg.seed,
            "device": str(self.device),
            "threads": torch.get_num_threads(),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "train_config": cfg.to_dict(),
            "model_config": self.model_config.to_dict(),
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
                "window_starts": self.starts,
                "mqar": {
                    "examples": cfg.mqar_eval_examples,
                    "num_kv_pairs": cfg.mqar_kv_pairs,
                    "seq_len": cfg.seq_len,
                    "seed": MQAR_EVAL_SEED,
                },
            },
            "history": self.history,
            "final": None,
            "sample": None,
        }

    # -------------------------------------------------------------- state IO
    def _state_tensors(self) -> tuple[dict[str, torch.Tensor], dict]:
        tensors, opt_meta = _optimizer_payload(self.optimizer, self.opt_names)
        tensors["rng/data"] = self.data_gen.get_state().clone()
        tensors["rng/torch"] = torch.get_rng_state().clone()
        if self.device.type == "cuda":
            for i, s in enumerate(torch.cuda.get_rng_state_all()):
                tensors[f"rng/cuda/{i}"] = s.clone()
        return tensors, opt_meta

    def save(self) -> Path:
        """Write the resume checkpoint (atomically, as a folder rename) and publish weights + metrics."""
        from safetensors.torch import save as st_save

        from .checkpoint import save_pretrained

        root = self.run_dir / STATE_DIR
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step-{self.step:07d}"
        if not (final / "state.json").is_file():
            tmp = root / f".tmp-step-{self.step:07d}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                save_pretrained(self.model, tmp)
                tensors, opt_meta = self._state_tensors()
                _atomic_write(tmp / "optimizer.safetensors", st_save(tensors, metadata={"producer": "k3lab.train"}))
                state = {
                    "step": self.step,
                    "wall_time": self._wall(),
                    "train_config": self.cfg.to_dict(),
                    "optimizer": opt_meta,
                    "metrics": self.metrics,
                }
                _write_json(tmp / "state.json", state)
                _fsync_dir(tmp)
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
                _fsync_dir(root)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        for old in root.iterdir():
            if old != final and (old.name.startswith("step-") or old.name.startswith(".tmp-")):
                shutil.rmtree(old, ignore_errors=True)
        self.publish()
        return final

    def publish(self) -> None:
        """config.json + model.safetensors + metrics.json at the top of the run directory."""
        from .checkpoint import save_pretrained

        save_pretrained(self.model, self.run_dir)
        self.write_metrics()

    def write_metrics(self) -> None:
        """metrics.json (atomically); between checkpoints it may run ahead of the saved weights."""
        self.metrics["history"] = self.history
        self.metrics["step"] = self.step
        _write_json(self.run_dir / METRICS_NAME, self.metrics)

    def _load_state(self, state_dir: Path) -> None:
        from safetensors.torch import load_file

        state = json.loads((state_dir / "state.json").read_text())
        tensors = load_file(str(state_dir / "optimizer.safetensors"))
        opt = {k: v for k, v in tensors.items() if not k.startswith("rng/")}
        _restore_optimizer(self.optimizer, self.opt_names, opt, state["optimizer"])
        self.data_gen.set_state(tensors["rng/data"])
        torch.set_rng_state(tensors["rng/torch"])
        if self.device.type == "cuda":
            cuda = [tensors[k] for k in sorted(tensors) if k.startswith("rng/cuda/")]
            if len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda)
        self.step = int(state["step"])
        self.wall_prior = float(state["wall_time"])
        saved = state["metrics"]
        self.history = {
            k: [e for e in saved["history"].get(k, []) if e["step"] <= self.step]
            for k in ("train", "val", "moe", "attnres")
        }
        for key in ("created", "command", "code_version"):
            self.metrics[key] = saved.get(key, self.metrics[key])
        if self.command and self.command != saved.get("command"):
            self.metrics["resumed_with"] = saved.get("resumed_with", []) + [self.command]
        self.metrics["history"] = self.history

    def _wall(self) -> float:
        return self.wall_prior + (time.perf_counter() - self.t_session)

    # -------------------------------------------------------------- per-step pieces
    def _zero_moe_acc(self) -> dict[int, torch.Tensor]:
        return {
            layer.layer_idx: torch.zeros(self.model_config.num_experts, dtype=torch.long)
            for layer in self.model.model.layers
            if layer.is_moe
        }

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        x, y = random_batches(self.corpus.train, cfg.batch_size, cfg.seq_len, generator=self.data_gen)
        if cfg.mqar_fraction > 0:
            x, y, _ = mix_mqar(
                x,
                y,
                cfg.mqar_fraction,
                cfg.mqar_kv_pairs,
                generator=self.data_gen,
                vocab_size=self.model_config.vocab_size,
            )
        return x.to(self.device), y.to(self.device)

    def train_step(self) -> dict[str, float]:
        """One optimizer step; returns its loss, aux loss and gradient norm."""
        cfg, model, mcfg = self.cfg, self.model, self.model_config
        lr = lr_at(self.step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        x, y = self._batch()
        out = model(x, targets=y)
        loss = out.loss
        aux = None
        if mcfg.balancing == "aux_loss" and out.aux_loss is not None:
            aux = out.aux_loss
            loss = loss + mcfg.aux_loss_coef * aux
        if not torch.isfinite(loss):
            raise TrainError(f"loss is {float(loss)} at step {self.step}; lower --lr or check the data")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
        else:
            gnorm = float(
                torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
            )
        for layer in model.model.layers:
            if layer.is_moe and layer.block_sparse_moe.last_load is not None:
                self._moe_acc[layer.layer_idx] += layer.block_sparse_moe.last_load.cpu()
        self.optimizer.step()
        if mcfg.balancing in ("sign", "quantile"):
            model.update_router_biases()
        self.step += 1
        return {
            "loss": float(out.loss.detach()),
            "aux_loss": None if aux is None else float(aux.detach()),
            "grad_norm": gnorm,
            "lr": lr,
            "tokens": x.numel(),
        }

    def log_moe(self) -> None:
        if not self._moe_acc or not any(int(v.sum()) for v in self._moe_acc.values()):
            return
        layers = {}
        for layer in self.model.model.layers:
            if layer.is_moe:
                load = self._moe_acc[layer.layer_idx]
                bias = layer.block_sparse_moe.gate.e_score_correction_bias
                layers[str(layer.layer_idx)] = {
                    "load": load.tolist(),
                    **moe_load_stats(load),
                    "bias": [round(float(b), 6) for b in bias],
                }
        self.history["moe"].append({"step": self.step, "layers": layers})
        self._moe_acc = self._zero_moe_acc()

    @torch.no_grad()
    def attnres_summary(self, trace) -> dict[str, Any] | None:
        """Per-site pseudo-query norm and mean depth weights (or scale/bias means in scale_bias mode)."""
        mode = self.model_config.residual
        if mode == "scale_bias":
            layers = {}
            for i, layer in enumerate(self.model.model.layers):
                layers[str(i)] = {
                    "attn_scale_mean": float(layer.self_attention_res_scale.mean()),
                    "attn_bias_mean": float(layer.self_attention_res_bias.mean()),
                    "mlp_scale_mean": float(layer.mlp_res_scale.mean()),
                    "mlp_bias_mean": float(layer.mlp_res_bias.mean()),
                }
            return {"step": self.step, "mode": mode, "layers": layers}
        if mode not in ("block_attnres", "full_attnres") or trace is None:
            return None
        names = trace.meta.get("attnres_sources", {})
        sites = {}
        for site, sources in names.items():
            p = trace.arrays.get(f"attnres.{site}")
            qn = trace.arrays.get(f"attnres.{site}_query_norm")
            if p is None:
                continue
            sites[site] = {
                "query_norm": None if qn is None else float(qn),
                "mean_weights": [round(float(v), 6) for v in p.reshape(-1, p.shape[-1]).mean(0)],
                "sources": list(sources),
            }
        return {"step": self.step, "mode": mode, "sites": sites}

    def validate(self) -> dict[str, Any]:
        """Val loss / bits per byte on the recorded windows, MQAR accuracy, and AttnRes summary."""
        from .trace import record

        cfg = self.cfg
        trace = None
        first = self.starts[: cfg.eval_batch_size]
        rest = self.starts[cfg.eval_batch_size :]
        try:
            with record(self.model, what={"attnres"}, max_batch=cfg.eval_batch_size, max_tokens=cfg.seq_len) as trace:
                l1, _ = evaluate_bits_per_byte(self.model, self.corpus.val, first, cfg.seq_len, cfg.eval_batch_size)
        except RuntimeError:  # another recorder is active (e.g. the app is tracing): no summary this time
            trace = None
            l1, _ = evaluate_bits_per_byte(self.model, self.corpus.val, first, cfg.seq_len, cfg.eval_batch_size)
        total = l1 * len(first)
        if rest:
            l2, _ = evaluate_bits_per_byte(self.model, self.corpus.val, rest, cfg.seq_len, cfg.eval_batch_size)
            total += l2 * len(rest)
        val_loss = total / len(self.starts)
        acc = evaluate_mqar(self.model, cfg.mqar_eval_examples, cfg.seq_len, cfg.mqar_kv_pairs, cfg.eval_batch_size)
        entry = {
            "step": self.step,
            "tokens": self.step * cfg.batch_size * cfg.seq_len,
            "wall_time": self._wall(),
            "val_loss": val_loss,
            "val_bpb": val_loss / LN2,
            "mqar_accuracy": acc,
        }
        self.history["val"].append(entry)
        summary = self.attnres_summary(trace)
        if summary is not None:
            self.history["attnres"].append(summary)
        return entry

    # -------------------------------------------------------------- the loop
    def _stop_requested(self) -> bool:
        return self._sigint or (self.stop_event is not None and self.stop_event.is_set())

    def run(self) -> str:
        """Train until ``steps`` (or stop_at / interruption). Returns the final status."""
        from tqdm.auto import tqdm

        cfg = self.cfg
        self.t_session = time.perf_counter()
        self.metrics["status"] = "running"
        bar = tqdm(
            total=cfg.steps,
            initial=self.step,
            disable=not cfg.progress,
            unit="step",
            dynamic_ncols=True,
            desc=self.run_dir.name,
        )
        interval = {"loss": 0.0, "n": 0, "tokens": 0, "t0": time.perf_counter()}
        status = "finished"
        try:
            while self.step < cfg.steps:
                if self._stop_requested():
                    raise _Interrupted
                info = self.train_step()
                interval["loss"] += info["loss"]
                interval["n"] += 1
                interval["tokens"] += info["tokens"]
                bar.update(1)
                if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                    dt = max(time.perf_counter() - interval["t0"], 1e-9)
                    loss = interval["loss"] / interval["n"]
                    entry = {
                        "step": self.step,
                        "tokens": self.step * cfg.batch_size * cfg.seq_len,
                        "wall_time": self._wall(),
                        "lr": info["lr"],
                        "loss": loss,
                        "bpb": loss / LN2,
                        "grad_norm": info["grad_norm"],
                        "tokens_per_s": interval["tokens"] / dt,
                    }
                    if info["aux_loss"] is not None:
                        entry["aux_loss"] = info["aux_loss"]
                    self.history["train"].append(entry)
                    self.log_moe()
                    self.write_metrics()
                    bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{entry['tokens_per_s']:.0f}", lr=f"{info['lr']:.2e}")
                    interval = {"loss": 0.0, "n": 0, "tokens": 0, "t0": time.perf_counter()}
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
                    v = self.validate()
                    bar.write(f"step {self.step}: val {v['val_bpb']:.3f} bits/byte, MQAR acc {v['mqar_accuracy']:.3f}")
                if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.steps:
                    self.save()
                if self.callback is not None:
                    self.callback(self.step, info)
                if cfg.stop_at is not None and self.step >= cfg.stop_at and self.step < cfg.steps:
                    status = "stopped"
                    break
        except (KeyboardInterrupt, _Interrupted):
            status = "interrupted"
        finally:
            bar.close()
        if status != "finished":
            self.metrics["status"] = status
            self.save()
            return status
        self.finish()
        return status

    def finish(self) -> None:
        """Final validation, sample, model card; drop the resume state unless keep_state."""
        cfg = self.cfg
        last = self.history["val"][-1] if self.history["val"] else None
        if last is None or last["step"] != self.step:
            last = self.validate()
        self.log_moe()
        sample = (
            generate_text(
                self.model,
                cfg.sample_prompt,
                cfg.sample_tokens,
                cfg.sample_temperature,
                cfg.sample_top_k,
                seed=cfg.seed,
            )
            if cfg.sample_tokens
            else ""
        )
        self.metrics["sample"] = {
            "prompt": cfg.sample_prompt,
            "text": sample,
            "max_new_tokens": cfg.sample_tokens,
            "temperature": cfg.sample_temperature,
            "top_k": cfg.sample_top_k,
            "seed": cfg.seed,
        }
        self.metrics["final"] = {
            "step": self.step,
            "tokens_seen": self.step * cfg.batch_size * cfg.seq_len,
            "wall_time_s": self._wall(),
            "val_loss": last["val_loss"],
            "val_bpb": last["val_bpb"],
            "mqar_accuracy": last["mqar_accuracy"],
        }
        self.metrics["status"] = "finished"
        if cfg.keep_state:
            self.save()
        else:
            self.publish()
            shutil.rmtree(self.run_dir / STATE_DIR, ignore_errors=True)
        _atomic_write(self.run_dir / "README.md", model_card(self.metrics).encode())


# ------------------------------------------------------------------------------------------ model card
def model_card(metrics: dict[str, Any]) -> str:
    """A short README.md for a finished run, from its metrics."""
    mc = metrics["model_config"]
    cfg = K3Config.from_dict(mc)
    fin = metrics["final"] or {}
    data = metrics["data"]
    params = metrics["params"]
    types = cfg.layer_types()
    moe = (
        (
            f"{'LatentMoE' if cfg.is_latent_moe else 'plain MoE'}: {cfg.num_experts} routed experts, top-"
            f"{cfg.num_experts_per_token}, {cfg.num_shared_experts} shared, expert width {cfg.moe_intermediate_size}"
            + (f", latent width {cfg.routed_expert_hidden_size}" if cfg.is_latent_moe else "")
            + f", balancing {cfg.balancing}"
        )
        if cfg.num_experts
        else "dense FFN in every layer"
    )
    residual = cfg.residual + (f" (block size {cfg.attn_res_block_size})" if cfg.residual == "block_attnres" else "")
    sample = (metrics.get("sample") or {}).get("text", "")
    prompt = (metrics.get("sample") or {}).get("prompt", "")
    base = data["unigram_baseline_bpb"]
    lines = [
        f"# {metrics['run_name']}",
        "",
        f"A byte-level K3-style language model trained with `k3lab train` ({metrics['code_version']}).",
        "",
        "| | |",
        "|---|---|",
        f"| layers | {cfg.num_hidden_layers} ({''.join(t[0] for t in types)}: K = KDA, M = MLA), hidden size "
        f"{cfg.hidden_size} |",
        f"| KDA | {cfg.kda_num_heads} heads x {cfg.kda_head_dim}, gate {cfg.kda_gate} |",
        f"| FFN | {cfg.hidden_act}; {moe} |",
        f"| residual | {residual} |",
        f"| parameters | {params['total']:,} total, {params['active']:,} active per token |",
        f"| data | {data['source']}; val: {', '.join(data['val_names'])} |",
        f"| training | {fin.get('step', 0):,} steps, {fin.get('tokens_seen', 0):,} tokens, "
        f"{fin.get('wall_time_s', 0.0) / 60:.1f} min on {metrics['device']} ({metrics['threads']} threads), "
        f"seed {metrics['seed']} |",
        f"| val bits/byte | **{fin.get('val_bpb', float('nan')):.3f}** (unigram baseline {base:.3f}) |",
        f"| MQAR accuracy | {fin.get('mqar_accuracy', float('nan')):.3f} "
        f"({metrics['eval']['mqar']['num_kv_pairs']} key-value pairs) |",
        "",
        'Load it with `K3ForCausalLM.from_pretrained("<this folder>")`; `metrics.json` holds the loss curve, '
        "validation history, MoE load and AttnRes weights over training.",
        "",
    ]
    if metrics.get("command"):
        lines += ["Reproduce:", "", "```", metrics["command"], "```", ""]
    if sample:
        lines += [
            f"Sample (temperature {metrics['sample']['temperature']}):",
            "",
            "```",
            (prompt + sample).rstrip(),
            "```",
            "",
        ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ API
def _check_resume_config(stored: TrainConfig, given: dict[str, Any]) -> TrainConfig:
    """Stored config updated with runtime fields from ``given``; other differing fields are an error."""
    changes = {}
    for key, value in given.items():
        if getattr(stored, key) == value:
            continue
        if key not in RUNTIME_FIELDS:
            raise TrainError(
                f"cannot change {key!r} when resuming (run has {getattr(stored, key)!r}, got {value!r}); "
                f"start a new run instead"
            )
        changes[key] = value
    return dataclasses.replace(stored, **changes)


def train(
    config: TrainConfig | dict[str, Any],
    resume: bool = False,
    callback: Callable[[int, dict], Any] | None = None,
    stop_event: threading.Event | None = None,
    command: str | None = None,
) -> Path:
    """Train (or, with ``resume``, continue) a run; returns the run directory.

    ``config`` is a TrainConfig or a dict of its fields. With ``resume=True`` the run directory
    ``config.out_dir`` must hold a resume checkpoint; its stored configuration wins, and only runtime
    fields (device, threads, stop_at, save_every, ...) may differ (a dict may name just those).
    ``callback(step, info)`` runs after every step (raising KeyboardInterrupt there interrupts the run
    cleanly, as Ctrl-C does); setting ``stop_event`` stops at the next step boundary. Interrupted and
    stopped runs are saved and can be resumed.
    """
    given = config.to_dict() if isinstance(config, TrainConfig) else dict(config)
    if resume:
        out = Path(given.get("out_dir", TrainConfig.out_dir))
        state_dir = latest_state_dir(out)
        if state_dir is None:
            if (out / METRICS_NAME).is_file() and load_metrics(out).get("status") == "finished":
                raise TrainError(f"{out}: this run already finished (no resume state left)")
            raise TrainError(f"{out}: no resume checkpoint found (expected {out / STATE_DIR}/step-*)")
        stored = TrainConfig.from_dict(json.loads((state_dir / "state.json").read_text())["train_config"])
        if isinstance(config, TrainConfig):
            given = {k: v for k, v in given.items() if k in RUNTIME_FIELDS}
        given.setdefault("stop_at", None)  # an earlier --stop-at does not carry over
        cfg = _check_resume_config(stored, given)
    else:
        cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(given)
        state_dir = None
        run_dir = Path(cfg.out_dir)
        if latest_state_dir(run_dir) is not None or (run_dir / METRICS_NAME).is_file():
            raise TrainError(f"{run_dir} already holds a run; use --resume to continue it or choose another --out")
    trainer = Trainer(cfg, callback=callback, stop_event=stop_event, command=command)
    threads_before = torch.get_num_threads()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = None
    try:
        trainer.setup(state_dir)
        trainer.run_dir.mkdir(parents=True, exist_ok=True)
        if state_dir is None:
            trainer.save()  # step 0: the run directory is valid (and resumable) from the start
        if main_thread:

            def on_sigint(signum, frame):  # first Ctrl-C: stop after this step; second: default behaviour
                trainer._sigint = True
                signal.signal(signal.SIGINT, signal.default_int_handler)

            previous = signal.signal(signal.SIGINT, on_sigint)
        trainer.run()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        torch.set_num_threads(threads_before)
    return trainer.run_dir


# ------------------------------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(
        prog="k3lab train",
        description="Train a K3 config on bytes (Shakespeare by default) on this machine, with periodic "
        "validation (bits per byte, MQAR accuracy), atomic checkpoints and exact resume.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  k3lab train k3-nano --steps 200 --out runs/nano\n"
        "  k3lab train k3-mini --set residual=plain --set num_experts=8 --out runs/plain\n"
        "  k3lab train my_config.json --data notes/ --mqar-fraction 0.1 --out runs/mine\n"
        "  k3lab train --resume runs/mini          (after Ctrl-C or --stop-at)\n\n"
        "Ctrl-C saves a checkpoint and exits; at most --save-every steps are lost on a crash.",
    )
    p.add_argument("model", nargs="?", help=f"preset name, config.json or checkpoint folder (default {d.model})")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a K3Config field (JSON value), repeatable: --set residual=plain",
    )
    p.add_argument("--out", dest="out_dir", help="run directory (default runs/<model name>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    p.add_argument("--data", help=f"'shakespeare' or a text file / folder (default {d.data})")
    p.add_argument("--val-plays", nargs="+", help="Shakespeare plays held out for validation")
    g = p.add_argument_group("schedule")
    g.add_argument("--steps", type=int, help=f"total optimizer steps (default {d.steps})")
    g.add_argument("--batch-size", type=int, help=f"sequences per step (default {d.batch_size})")
    g.add_argument("--seq-len", type=int, help=f"bytes per sequence (default {d.seq_len})")
    g.add_argument("--lr", type=float, help=f"peak learning rate (default {d.lr})")
    g.add_argument("--min-lr-ratio", type=float, help=f"final lr / peak lr of the cosine (default {d.min_lr_ratio})")
    g.add_argument("--warmup", dest="warmup_steps", type=int, help=f"linear warmup steps (default {d.warmup_steps})")
    g.add_argument("--weight-decay", type=float, help=f"AdamW decay on matrices (default {d.weight_decay})")
    g.add_argument("--beta1", type=float, help=f"AdamW beta1 (default {d.beta1})")
    g.add_argument("--beta2", type=float, help=f"AdamW beta2 (default {d.beta2})")
    g.add_argument("--grad-clip", type=float, help=f"global grad-norm clip, 0 = off (default {d.grad_clip})")
    g.add_argument("--seed", type=int, help=f"seed for init and data order (default {d.seed})")
    g.add_argument(
        "--mqar-fraction", type=float, help=f"share of MQAR rows in training batches (default {d.mqar_fraction})"
    )
    g.add_argument("--mqar-kv-pairs", type=int, help=f"MQAR key-value pairs (default {d.mqar_kv_pairs})")
    e = p.add_argument_group("evaluation, logging, checkpoints")
    e.add_argument(
        "--eval-every", type=int, help=f"validate every N steps, 0 = only at the end (default {d.eval_every})"
    )
    e.add_argument("--eval-windows", type=int, help=f"validation windows (default {d.eval_windows})")
    e.add_argument("--eval-batch-size", type=int, help=f"(default {d.eval_batch_size})")
    e.add_argument("--mqar-eval-examples", type=int, help=f"MQAR validation sequences (default {d.mqar_eval_examples})")
    e.add_argument("--log-every", type=int, help=f"history / MoE-load interval in steps (default {d.log_every})")
    e.add_argument(
        "--save-every", type=int, help=f"checkpoint every N steps, 0 = only on exit (default {d.save_every})"
    )
    e.add_argument("--stop-at", type=int, help="save and stop after this step (resume later with --resume)")
    e.add_argument(
        "--keep-state",
        action="store_true",
        default=None,
        help="keep the optimizer/RNG resume state after the run finishes",
    )
    e.add_argument("--sample-tokens", type=int, help=f"bytes generated for the model card (default {d.sample_tokens})")
    e.add_argument("--prompt", dest="sample_prompt", help=f"prompt of the sample (default {d.sample_prompt!r})")
    r = p.add_argument_group("machine")
    r.add_argument("--device", help="cpu, cuda, cuda:1, or auto (default: cuda when available)")
    r.add_argument("--threads", type=int, help="torch CPU threads")
    r.add_argument("--no-progress", dest="progress", action="store_false", default=None, help="no progress bar")
    return p


def _args_to_dict(args: argparse.Namespace) -> dict[str, Any]:
    skip = {"resume", "model", "overrides"}
    return {k: v for k, v in vars(args).items() if k not in skip and v is not None}


def main(argv: list[str] | None = None) -> int:
    """``k3lab train ...``: returns 0 when the run finished or stopped at --stop-at, 130 on Ctrl-C, 2 on errors."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    command = "k3lab train " + shlex.join(argv)
    try:
        given = _args_to_dict(args)
        if args.resume:
            if args.model or args.overrides:
                raise TrainError("--resume continues a run with its stored config; do not pass a model or --set")
            if args.out_dir and Path(args.out_dir) != Path(args.resume):
                raise TrainError("--resume RUN_DIR already names the run directory; drop --out")
            given["out_dir"] = args.resume
            path = train(given, resume=True, command=command)
        else:
            model = args.model or TrainConfig.model
            overrides = parse_overrides(args.overrides)
            given.setdefault("out_dir", str(Path("runs") / Path(model).stem))
            path = train(TrainConfig.from_dict({**given, "model": model, "overrides": overrides}), command=command)
    except (TrainError, ConfigError) as exc:
        print(f"k3lab train: error: {exc}", file=sys.stderr)
        return 2
    metrics = load_metrics(path)
    status = metrics["status"]
    if status == "finished":
        fin = metrics["final"]
        print(
            f"finished {path}: val {fin['val_bpb']:.3f} bits/byte (unigram "
            f"{metrics['data']['unigram_baseline_bpb']:.3f}), MQAR acc {fin['mqar_accuracy']:.3f}, "
            f"{fin['tokens_seen']:,} tokens in {fin['wall_time_s'] / 60:.1f} min"
        )
        return 0
    print(f"{status} after step {metrics['step']}; checkpoint saved. Continue with: k3lab train --resume {path}")
    return 130 if status == "interrupted" else 0


if __name__ == "__main__":
    sys.exit(main())
