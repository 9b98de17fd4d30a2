"""What defines a training run: ``TrainConfig`` (validated), ``--set`` overrides, the model config and
the corpus it names, and which fields a resumed run may change."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..data import Corpus, load_shakespeare, load_text_path
from ..data.mqar import segment_queries
from ..loading.folder import config_from_json
from ..modeling.config import ConfigError, K3Config
from ..modeling.model import K3ForCausalLM
from ..modeling.presets import PRESETS, from_preset

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


@dataclass
class TrainConfig:
    """Everything that defines a training run (see k3core.training.loop for the update rule)."""

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
    mqar_queries: int | None = None  # queries per MQAR training row (None: one per pair; more: keys asked again)
    mqar_loss_weight: float = 1.0  # weight of an MQAR answer in the training loss, against 1 for a text byte
    mqar_curriculum_steps: int = 0  # MQAR pairs grow from mqar_kv_pairs_start to mqar_kv_pairs over these steps
    mqar_kv_pairs_start: int = 1
    mqar_span_start: int | None = None  # with the curriculum: MQAR rows packed from examples this long at step 0
    mqar_eval_examples: int = 32
    log_every: int = 10
    save_every: int = 100  # checkpoint every N steps; 0: only on stop/interrupt/end
    seed: int = 0
    device: str = "auto"  # "auto": cuda when available, else cpu
    threads: int | None = None  # torch CPU threads (None: torch's default)
    compile: bool = False  # train through torch.compile (fused kernels; minutes to compile, then faster steps)
    compile_after: int = 0  # with compile: the first steps run eager (an eager rerun checks them bit for bit)
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
        for name in (
            "steps",  # 0: no step, the run is its initialisation, validated (an untrained reference)
            "warmup_steps",
            "eval_every",
            "save_every",
            "sample_tokens",
            "mqar_curriculum_steps",
            "compile_after",
        ):
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
        queries = self.mqar_kv_pairs if self.mqar_queries is None else self.mqar_queries
        if not isinstance(queries, int) or queries < 1:
            raise TrainError(f"mqar_queries must be a positive integer, got {self.mqar_queries!r}")
        if self.mqar_fraction > 0 and self.seq_len < 2 * self.mqar_kv_pairs + queries:
            raise TrainError(
                f"seq_len={self.seq_len} is too short for MQAR with {self.mqar_kv_pairs} pairs and {queries} "
                f"queries (needs >= {2 * self.mqar_kv_pairs + queries})"
            )
        if not (isinstance(self.mqar_kv_pairs_start, int) and 1 <= self.mqar_kv_pairs_start <= self.mqar_kv_pairs):
            raise TrainError(
                f"mqar_kv_pairs_start must be in [1, mqar_kv_pairs={self.mqar_kv_pairs}], "
                f"got {self.mqar_kv_pairs_start!r}"
            )
        if self.mqar_span_start is not None:
            if self.mqar_curriculum_steps == 0:
                raise TrainError("mqar_span_start needs a curriculum (mqar_curriculum_steps > 0) to grow over")
            need = 2 * self.mqar_kv_pairs_start + segment_queries(queries, self.seq_len, self.mqar_span_start)
            if not (isinstance(self.mqar_span_start, int) and need <= self.mqar_span_start <= self.seq_len):
                raise TrainError(
                    f"mqar_span_start must be in [{need}, seq_len={self.seq_len}] (2 x {self.mqar_kv_pairs_start} "
                    f"starting pairs + the segment's queries), got {self.mqar_span_start!r}"
                )
        if self.compile_after and not self.compile:
            raise TrainError("compile_after is the number of eager steps before compiling: it needs compile")
        if not self.mqar_loss_weight > 0:
            raise TrainError(f"mqar_loss_weight must be > 0, got {self.mqar_loss_weight}")
        if self.stop_at is not None and not 0 < self.stop_at:
            raise TrainError(f"stop_at must be a positive step number, got {self.stop_at}")
        if self.threads is not None and self.threads < 1:
            raise TrainError(f"threads must be >= 1, got {self.threads}")
        if self.sample_temperature < 0:
            raise TrainError("sample_temperature must be >= 0 (0: greedy)")
        if not isinstance(self.overrides, dict):
            raise TrainError("overrides must be a dict of K3Config fields")

    def mqar_pairs_at(self, step: int) -> int:
        """MQAR pairs of a training row at ``step``: ``start + floor((D - start) * min(1, step / curriculum))``,
        from ``mqar_kv_pairs_start`` to ``D = mqar_kv_pairs`` (always ``D`` without a curriculum)."""
        if self.mqar_curriculum_steps == 0:
            return self.mqar_kv_pairs
        grown = (self.mqar_kv_pairs - self.mqar_kv_pairs_start) * min(step, self.mqar_curriculum_steps)
        return self.mqar_kv_pairs_start + grown // self.mqar_curriculum_steps

    def mqar_span_at(self, step: int) -> int:
        """Length of the packed MQAR examples at ``step``: ``S0 + floor((T - S0) * min(1, step / curriculum))``
        from ``S0 = mqar_span_start`` to ``T = seq_len``, one example per row (always ``T`` without
        ``mqar_span_start``). Grows with the pairs (:meth:`mqar_pairs_at`) over the same steps."""
        if self.mqar_span_start is None or self.mqar_curriculum_steps == 0:
            return self.seq_len
        grown = (self.seq_len - self.mqar_span_start) * min(step, self.mqar_curriculum_steps)
        return self.mqar_span_start + grown // self.mqar_curriculum_steps

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise TrainError(f"unknown training options: {unknown}")
        return cls(**data)


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
    path = Path(spec)
    if spec in PRESETS:
        cfg = from_preset(spec)
    elif path.is_dir() and (path / "config.json").is_file():
        cfg = config_from_json(json.loads((path / "config.json").read_text()))
    elif path.is_file():
        try:
            cfg = config_from_json(json.loads(path.read_text()))
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
    try:
        if cfg.data == "shakespeare":
            return load_shakespeare(cfg.val_plays)
        path = Path(cfg.data)
        if not path.exists():
            raise TrainError(f"--data {cfg.data!r}: no such file or folder (use 'shakespeare' or a text path)")
        return load_text_path(path)
    except TrainError:
        raise
    except ValueError as exc:  # unknown play, binary or empty file: a usage error, not a crash
        raise TrainError(str(exc)) from exc


def check_resume_config(stored: TrainConfig, given: dict[str, Any]) -> TrainConfig:
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


def derive_seed(seed: int, purpose: str) -> int:
    """An independent 63-bit seed for one purpose: ``sha256(f"{seed}:{purpose}")`` truncated."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{purpose}".encode()).digest()[:8], "little") >> 1


def initial_model(config: K3Config, seed: int) -> K3ForCausalLM:
    """The model a run with this seed starts from: ``config``'s modules initialised under
    ``torch.manual_seed(derive_seed(seed, "init"))``, on the CPU, in fp32 (this moves the global random stream)."""
    torch.manual_seed(derive_seed(seed, "init"))
    return K3ForCausalLM.from_config(config)


def resolve_device(name: str) -> torch.device:
    """``"auto"``: cuda when available, else cpu; a named CUDA device must exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise TrainError(f"--device {name!r}: {exc}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TrainError("--device cuda requested but CUDA is not available")
    return dev
