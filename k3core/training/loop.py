"""The training loop: :func:`train` and the :class:`Trainer` holding a run's moving parts.

What a step does (``s`` = completed steps so far, ``N`` = ``steps``)::

    x, y  = text windows from the train split (+ MQAR rows, fraction ``mqar_fraction``; with a curriculum
            their pairs and, packed, their example length grow: mqar_pairs_at, mqar_span_at)
    loss  = CE(model(x), y)                    (+ aux_loss_coef * aux_loss when balancing="aux_loss"; MQAR answers
                                                weighted mqar_loss_weight: weighted_recall_loss)
    g     = clip(grad loss, grad_clip)         (global L2 norm)
    theta = AdamW(theta, g, lr(s))             (decay only on >= 2-D weights; lr(s): k3core.training.schedule)
    e_bias updated (k3core.training.balancing.update_router_biases) when balancing is "sign" or "quantile"

A checkpoint is written every ``save_every`` steps and on Ctrl-C (SIGINT: finish the current step,
save, exit). Resuming restores the weights, AdamW moments, the LR-schedule position, the data
generator and torch RNG states and the history, so an interrupted run ends with the same weights as
an uninterrupted one with the same seed: bit for bit on CPU with the same thread count and code
version (CUDA kernels such as index_add_ are not deterministic, so GPU runs agree only closely).
"""

from __future__ import annotations

import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..data import IGNORE_INDEX, eval_window_starts, mix_mqar, random_batches
from ..generation.decode import generate_text
from ..interp.recorder import record
from ..loading.pretrained import save_pretrained
from ..modeling.model import K3ForCausalLM
from ..utils.files import atomic_write_text, check_output_folder
from .balancing import update_router_biases
from .card import model_card
from .config import (
    RUNTIME_FIELDS,
    TrainConfig,
    TrainError,
    check_resume_config,
    derive_seed,
    initial_model,
    load_corpus,
    resolve_device,
    resolve_model_config,
)
from .evaluate import LN2, evaluate_bits_per_byte, evaluate_mqar
from .history import HISTORY_KEYS, attnres_entry, final_entry, moe_entry, new_metrics, sample_entry, train_entry
from .rundir import (
    METRICS_NAME,
    STATE_DIR,
    latest_state_dir,
    load_metrics,
    optimizer_tensors,
    read_resume_state,
    read_state_json,
    restore_optimizer,
    restore_rng,
    rng_tensors,
    write_json,
    write_resume_state,
)
from .schedule import lr_at
from .tensorboard import TensorBoardLog


def weighted_recall_loss(logits: torch.Tensor, targets: torch.Tensor, mqar_rows: int, weight: float) -> torch.Tensor:
    """Cross-entropy with the MQAR answers (the last ``mqar_rows`` rows' scored targets) weighted ``weight``:
    ``sum_i w_i * nll_i / sum_i w_i`` over scored targets, ``w_i = weight`` on an answer and 1 on a text byte.

    With ``weight = 1`` this is the plain mean the model's ``loss`` is. An MQAR row scores only its queries, so
    its share of the loss is small at any row share; the weight sets it directly.
    """
    nll = torch.nn.functional.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view_as(targets)
    weights = (targets != IGNORE_INDEX).to(nll.dtype)
    weights[targets.shape[0] - mqar_rows :] *= weight
    return (weights * nll).sum() / weights.sum().clamp_min(1)


class _Interrupted(Exception):
    """Internal: a stop request (SIGINT, stop_event) was seen at a step boundary."""


class Trainer:
    """One training run (fresh or resumed). Use :func:`train`; this class holds the moving parts."""

    def __init__(
        self,
        cfg: TrainConfig,
        callback: Callable[[int, dict], Any] | None = None,
        stop_event: threading.Event | None = None,
        command: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.callback = callback
        self.stop_event = stop_event
        self.command = command
        self.run_dir = Path(cfg.out_dir)
        self.device = resolve_device(cfg.device)
        self._sigint = False
        self.tb: TensorBoardLog | None = None

    # -------------------------------------------------------------- set-up
    def setup(self, resume_from: Path | None) -> None:
        cfg = self.cfg
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        self.corpus = load_corpus(cfg)
        if len(self.corpus.train) < cfg.seq_len + 1:
            raise TrainError(f"training split has {len(self.corpus.train)} bytes, need > seq_len={cfg.seq_len}")
        try:
            self.starts = eval_window_starts(len(self.corpus.val), cfg.seq_len, cfg.eval_windows)
        except ValueError as exc:
            raise TrainError(str(exc)) from exc
        if resume_from is None:
            self.model_config = resolve_model_config(cfg.model, cfg.overrides)
            self.model = initial_model(self.model_config, cfg.seed).to(self.device)
        else:
            self.model = K3ForCausalLM.from_pretrained(resume_from).to(self.device)
            self.model_config = self.model.config
        if self.model_config.vocab_size < 256:
            raise TrainError(
                f"byte-level training needs vocab_size >= 256, the config has {self.model_config.vocab_size}"
            )
        self.model.train()
        # The compiled training forward (compiled lazily, at its first call, so from step compile_after on);
        # validation, recording, sampling and the first compile_after steps use the eager model (same parameters).
        self.compiled_forward = torch.compile(self.model) if cfg.compile else None
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
        self.history: dict[str, list] = {k: [] for k in HISTORY_KEYS}
        self.metrics = new_metrics(
            cfg, self.model, self.corpus, self.starts, self.run_dir.name, self.command, self.device, self.history
        )
        if resume_from is not None:
            self._load_state(resume_from)
        self._moe_acc = self._zero_moe_acc()
        # TensorBoard events beside metrics.json; on resume, those a previous session wrote after the checkpoint's
        # step (steps trained again now, from step + 1 on) are hidden.
        self.tb = TensorBoardLog(self.run_dir, purge_step=self.step + 1 if resume_from is not None else None)

    # -------------------------------------------------------------- state IO
    def save(self) -> Path:
        """Write the resume checkpoint (atomically, as a folder rename) and publish weights + metrics."""
        tensors, opt_meta = optimizer_tensors(self.optimizer, self.opt_names)
        tensors.update(rng_tensors(self.data_gen, self.device))
        state = {
            "step": self.step,
            "wall_time": self._wall(),
            "train_config": self.cfg.to_dict(),
            "optimizer": opt_meta,
            "metrics": self.metrics,
        }
        final = write_resume_state(self.run_dir, self.step, self.model, tensors, state)
        self.publish()
        return final

    def publish(self) -> None:
        """config.json + model.safetensors + metrics.json at the top of the run directory."""
        save_pretrained(self.model, self.run_dir)
        self.write_metrics()

    def write_metrics(self) -> None:
        """metrics.json (atomically); between checkpoints it may run ahead of the saved weights."""
        self.metrics["history"] = self.history
        self.metrics["step"] = self.step
        write_json(self.run_dir / METRICS_NAME, self.metrics)

    def _load_state(self, state_dir: Path) -> None:
        state, tensors = read_resume_state(state_dir)
        opt = {k: v for k, v in tensors.items() if not k.startswith("rng/")}
        restore_optimizer(self.optimizer, self.opt_names, opt, state["optimizer"])
        restore_rng(tensors, self.data_gen, self.device)
        self.step = int(state["step"])
        self.wall_prior = float(state["wall_time"])
        saved = state["metrics"]
        self.history = {k: [e for e in saved["history"].get(k, []) if e["step"] <= self.step] for k in HISTORY_KEYS}
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

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(x, y, number of MQAR rows): the text windows, of which the last rows are replaced by MQAR."""
        cfg = self.cfg
        x, y = random_batches(self.corpus.train, cfg.batch_size, cfg.seq_len, generator=self.data_gen)
        mqar_rows = 0
        if cfg.mqar_fraction > 0:
            x, y, mqar_rows = mix_mqar(
                x,
                y,
                cfg.mqar_fraction,
                cfg.mqar_pairs_at(self.step),
                generator=self.data_gen,
                span=cfg.mqar_span_at(self.step),
                vocab_size=self.model_config.vocab_size,
                num_queries=cfg.mqar_queries,
            )
        return x.to(self.device), y.to(self.device), mqar_rows

    def train_step(self) -> dict[str, float]:
        """One optimizer step; returns its loss, aux loss and gradient norm."""
        cfg, model, mcfg = self.cfg, self.model, self.model_config
        lr = lr_at(self.step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        x, y, mqar_rows = self._batch()
        compiled = self.compiled_forward is not None and self.step >= cfg.compile_after
        out = (self.compiled_forward if compiled else model)(x, targets=y)
        loss = out.loss
        if mqar_rows and cfg.mqar_loss_weight != 1.0:
            loss = weighted_recall_loss(out.logits, y, mqar_rows, cfg.mqar_loss_weight)
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
            grads = [p.grad.norm() for p in model.parameters() if p.grad is not None]
            gnorm = float(torch.linalg.vector_norm(torch.stack(grads)))
        for layer in model.model.layers:
            if layer.is_moe and layer.block_sparse_moe.last_load is not None:
                self._moe_acc[layer.layer_idx] += layer.block_sparse_moe.last_load.cpu()
        self.optimizer.step()
        if mcfg.balancing in ("sign", "quantile"):
            update_router_biases(model)
        self.step += 1
        return {
            "loss": float(out.loss.detach()),
            "aux_loss": None if aux is None else float(aux.detach()),
            "grad_norm": gnorm,
            "lr": lr,
            "tokens": x.numel(),
        }

    def log_moe(self) -> None:
        """Append the MoE load counted since the last entry to history.moe (nothing without MoE layers)."""
        if not self._moe_acc or not any(int(v.sum()) for v in self._moe_acc.values()):
            return
        self.history["moe"].append(moe_entry(self.model, self._moe_acc, self.step))
        self.tb.moe(self.history["moe"][-1])
        self._moe_acc = self._zero_moe_acc()

    def validate(self) -> dict[str, Any]:
        """Val loss / bits per byte on the recorded windows, MQAR accuracy, and AttnRes summary."""
        cfg = self.cfg
        trace = None
        first = self.starts[: cfg.eval_batch_size]
        rest = self.starts[cfg.eval_batch_size :]
        try:
            with record(self.model, what={"attnres"}, max_batch=cfg.eval_batch_size, max_tokens=cfg.seq_len) as trace:
                l1, _ = evaluate_bits_per_byte(self.model, self.corpus.val, first, cfg.seq_len, cfg.eval_batch_size)
        except RuntimeError:  # this thread is already recording (a caller's trace): no summary this time
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
        summary = attnres_entry(self.model, trace, self.step)
        if summary is not None:
            self.history["attnres"].append(summary)
            self.tb.attnres(summary)
        self.tb.val(entry)
        return entry

    # -------------------------------------------------------------- the loop
    def _stop_requested(self) -> bool:
        return self._sigint or (self.stop_event is not None and self.stop_event.is_set())

    def _log_interval(self, info: dict[str, Any], interval: dict[str, float]) -> dict[str, Any]:
        seconds = max(time.perf_counter() - interval["t0"], 1e-9)
        entry = train_entry(self.cfg, self.step, self._wall(), info, interval, seconds)
        self.history["train"].append(entry)
        self.tb.train(entry, seconds / interval["n"])
        self.log_moe()
        self.write_metrics()
        return entry

    def run(self) -> str:
        """Train until ``steps`` (or stop_at / interruption). Returns the final status."""
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
                    entry = self._log_interval(info, interval)
                    bar.set_postfix(
                        loss=f"{entry['loss']:.3f}", tok_s=f"{entry['tokens_per_s']:.0f}", lr=f"{info['lr']:.2e}"
                    )
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
        sample = ""
        if cfg.sample_tokens:
            sample = generate_text(
                self.model, cfg.sample_prompt, cfg.sample_tokens, cfg.sample_temperature, cfg.sample_top_k, cfg.seed
            )
        self.metrics["sample"] = sample_entry(cfg, sample)
        self.metrics["final"] = final_entry(cfg, self.step, self._wall(), last)
        self.metrics["status"] = "finished"
        if cfg.keep_state:
            self.save()
        else:
            self.publish()
            shutil.rmtree(self.run_dir / STATE_DIR, ignore_errors=True)
        atomic_write_text(self.run_dir / "README.md", model_card(self.metrics))


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
        out = check_output_folder(given.get("out_dir", TrainConfig.out_dir), (STATE_DIR, METRICS_NAME), "train run")
        state_dir = latest_state_dir(out)
        if state_dir is None:
            if (out / METRICS_NAME).is_file() and load_metrics(out).get("status") == "finished":
                raise TrainError(f"{out}: this run already finished (no resume state left)")
            raise TrainError(f"{out}: no resume checkpoint found (expected {out / STATE_DIR}/step-*)")
        stored = TrainConfig.from_dict(read_state_json(state_dir)["train_config"])
        if isinstance(config, TrainConfig):
            given = {k: v for k, v in given.items() if k in RUNTIME_FIELDS}
        given.setdefault("stop_at", None)  # an earlier --stop-at does not carry over
        cfg = check_resume_config(stored, given)
    else:
        cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(given)
        state_dir = None
        run_dir = Path(cfg.out_dir)
        if latest_state_dir(run_dir) is not None or (run_dir / METRICS_NAME).is_file():
            raise TrainError(f"{run_dir} already holds a run; use --resume to continue it or choose another --out")
        check_output_folder(run_dir, (), "train run")  # a new run: a new or empty folder, never the user's files
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

            def on_sigint(signum: int, frame: Any) -> None:  # first Ctrl-C: stop after this step; second: default
                trainer._sigint = True
                signal.signal(signal.SIGINT, signal.default_int_handler)

            previous = signal.signal(signal.SIGINT, on_sigint)
        trainer.run()
    finally:
        if trainer.tb is not None:
            trainer.tb.close()
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        torch.set_num_threads(threads_before)
    return trainer.run_dir
