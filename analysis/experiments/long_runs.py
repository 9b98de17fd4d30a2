"""Long-context measurements that run the model: recall by distance, seconds and memory per token against T.

These are not functions of a trace: each builds inputs, runs the model (``torch.no_grad``) and measures. Each
takes ``progress(done, total)`` and ``should_stop()`` callbacks (the app's progress bar and Stop button) and, when
stopped, returns the rows measured so far with ``attrs["stopped"] = True``.

- Recall by distance (MQAR-style, Zoology; ``k3core.data.mqar``'s key and value bytes): each example is
  ``k v`` (the queried pair), ``pairs - 1`` distractor pairs, filler, then the key ``k`` again at position
  ``1 + d``, so the value sits ``d`` tokens before the query. Accuracy = share of examples whose argmax next-token
  prediction at the query is ``v``; its 95% Wilson interval; chance = 1 / (number of values).
- Cost by length: wall seconds of one forward of ``T`` random byte tokens (best of ``repeats``) and the peak RSS
  growth of the process during it (sampled each millisecond, ``peak_rss_growth``: the whole process, so other
  app sessions running at the same time add to it); per token: ``seconds / T`` and ``bytes / T``; beside it the
  decode-cache model ``analysis.metrics.allocation.cache_bytes_by_length`` (KDA flat, MLA linear in T).
- The estimate before a run (``estimate_cost``): a calibration forward of ``T0`` tokens scaled by the FLOP
  model, ``t(T) = t(T0) * F(T) / F(T0)`` with ``F(T) = T (2 P + sum_l f_l(T))`` (``P`` parameters,
  ``f_l`` = ``analysis.metrics.allocation.sequence_mixing_flops``), and memory ``m(T) = m(T0) T / T0`` (linear: the MLA
  layers' attention runs in O(T) memory, ``k3core.ops.attention``).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pandas as pd
import torch

from analysis.metrics.allocation import cache_bytes_by_length, sequence_mixing_flops
from analysis.metrics.intervals import wilson_interval
from analysis.metrics.tidy import tidy

Progress = Callable[[int, int], None] | None
Stop = Callable[[], bool] | None
DEFAULT_DISTANCES = (16, 64, 256)
DEFAULT_LENGTHS = (128, 512, 2048)
MAX_BATCH_TOKENS = 16384  # examples per forward: at most this many tokens in one batch


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_growth(fn: Callable[[], Any], interval: float = 0.001) -> tuple[Any, int]:
    """Run ``fn()``; return its result and the peak of (RSS - RSS before) while it ran, in bytes, sampled every
    ``interval`` seconds by a thread (torch kernels release the GIL, so the sampler runs during them)."""
    before, peak, done = _rss_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = fn()
    finally:
        peak[0] = max(peak[0], _rss_bytes())
        done.set()
        sampler.join()
    return result, max(0, peak[0] - before)


def _value_ranges(vocab_size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    from k3core.data.mqar import _default_mqar_ranges

    return _default_mqar_ranges(vocab_size)


def recall_inputs(distance: int, examples: int, vocab_size: int, pairs: int = 4, seed: int = 0) -> dict[str, Any]:
    """MQAR-style inputs [examples, distance + 2]: the queried pair at 0..1, ``pairs - 1`` distractors, filler 0,
    the query key at position ``1 + distance``; returns inputs, query position, keys and values."""
    if distance < 2 * pairs:
        raise ValueError(f"distance {distance} must be at least 2 x pairs = {2 * pairs} (the pairs come first)")
    (k_lo, k_hi), (v_lo, v_hi) = _value_ranges(vocab_size)
    g = torch.Generator().manual_seed(seed + distance)
    keys = torch.stack([torch.randperm(k_hi - k_lo, generator=g)[:pairs] for _ in range(examples)]) + k_lo
    values = torch.stack([torch.randperm(v_hi - v_lo, generator=g)[:pairs] for _ in range(examples)]) + v_lo
    inputs = torch.zeros(examples, distance + 2, dtype=torch.int64)
    inputs[:, 0 : 2 * pairs : 2], inputs[:, 1 : 2 * pairs : 2] = keys, values
    inputs[:, 1 + distance] = keys[:, 0]
    return {"inputs": inputs, "query": 1 + distance, "key": keys[:, 0], "value": values[:, 0], "n_values": v_hi - v_lo}


@torch.no_grad()
def recall_by_distance(
    model: torch.nn.Module,
    distances: Iterable[int] = DEFAULT_DISTANCES,
    examples: int = 32,
    pairs: int = 4,
    seed: int = 0,
    progress: Progress = None,
    should_stop: Stop = None,
) -> pd.DataFrame:
    """Recall accuracy per distance (module docstring). Columns: distance, accuracy, correct, examples, ci_low,
    ci_high, chance."""
    distances = sorted({int(d) for d in distances})
    vocab = int(model.config.vocab_size)
    device = next(model.parameters()).device
    rows, stopped = [], False
    for n, d in enumerate(distances):
        if should_stop is not None and should_stop():
            stopped = True
            break
        batch = recall_inputs(d, examples, vocab, pairs, seed)
        per = max(1, MAX_BATCH_TOKENS // (d + 2))
        correct = 0
        for s in range(0, examples, per):
            ids = batch["inputs"][s : s + per].to(device)
            logits = model(ids).logits[:, batch["query"]]
            correct += int((logits.argmax(-1).cpu() == batch["value"][s : s + per]).sum())
        low, high = (float(v) for v in wilson_interval(correct, examples))
        rows.append(
            dict(
                distance=d,
                accuracy=correct / examples,
                correct=correct,
                examples=examples,
                ci_low=low,
                ci_high=high,
                chance=1.0 / batch["n_values"],
            )
        )
        if progress is not None:
            progress(n + 1, len(distances))
    table = tidy(
        pd.DataFrame(rows, columns=["distance", "accuracy", "correct", "examples", "ci_low", "ci_high", "chance"]),
        keys=["distance"],
        value="accuracy",
    )
    table.attrs["stopped"] = stopped
    return table


def _forward_flops(config: Any, n_params: int, T: int) -> float:
    """``F(T) = T (2 P + sum_l f_l(T))``: dense projections (2 FLOPs per parameter per token) plus the token
    mixers' per-token work (``analysis.metrics.allocation.sequence_mixing_flops``)."""
    mixing = sum(sequence_mixing_flops(config, layer, T) for layer in range(config.num_hidden_layers))
    return T * (2.0 * n_params + mixing)


def _random_ids(T: int, vocab: int, device: Any, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, min(vocab, 128), (1, T), generator=torch.Generator().manual_seed(seed)).to(device)


def _run_forward(model: torch.nn.Module, ids: torch.Tensor, record_what: Any) -> None:
    if record_what is None:
        model(ids, labels=ids)
        return
    from k3core.interp.recorder import record

    with record(model, what=record_what):
        model(ids, labels=ids)


@torch.no_grad()
def cost_by_length(
    model: torch.nn.Module,
    lengths: Iterable[int] = DEFAULT_LENGTHS,
    record_what: Any = None,
    repeats: int = 1,
    progress: Progress = None,
    should_stop: Stop = None,
) -> pd.DataFrame:
    """Measured seconds and peak memory of one forward per length (module docstring), beside the decode-cache
    model. Columns: seq_len, seconds, seconds_per_token, peak_bytes, bytes_per_token, cache_bytes,
    cache_bytes_kda, cache_bytes_mla. ``record_what``: None (the plain forward) or ``record(what=...)`` around it."""
    lengths = sorted({int(t) for t in lengths})
    config = model.config
    device = next(model.parameters()).device
    _run_forward(model, _random_ids(16, config.vocab_size, device), record_what)  # warm-up (lazy init, pools)
    cache = cache_bytes_by_length(config, lengths, dtype_bytes=4)
    rows, stopped = [], False
    for n, T in enumerate(lengths):
        if should_stop is not None and should_stop():
            stopped = True
            break
        ids = _random_ids(T, config.vocab_size, device)
        best, peak = math.inf, 0
        for _ in range(max(1, repeats)):
            start = time.perf_counter()
            _, grown = peak_rss_growth(lambda ids=ids: _run_forward(model, ids, record_what))
            best, peak = min(best, time.perf_counter() - start), max(peak, grown)
        at_t = cache[cache["seq_len"] == T].set_index("layer_type")["bytes"]
        rows.append(
            dict(
                seq_len=T,
                seconds=best,
                seconds_per_token=best / T,
                peak_bytes=peak,
                bytes_per_token=peak / T,
                cache_bytes=int(at_t["total"]),
                cache_bytes_kda=int(at_t["KDA"]),
                cache_bytes_mla=int(at_t["MLA"]),
            )
        )
        if progress is not None:
            progress(n + 1, len(lengths))
    table = (
        tidy(pd.DataFrame(rows), keys=["seq_len"], value="seconds_per_token")
        if rows
        else pd.DataFrame(
            columns=["seq_len", "seconds", "seconds_per_token", "peak_bytes", "bytes_per_token", "cache_bytes"]
        )
    )
    table.attrs["stopped"] = stopped
    table.attrs["recorded"] = record_what is not None
    return table


@torch.no_grad()
def estimate_cost(
    model: torch.nn.Module,
    lengths: Iterable[int],
    calibrate: int = 256,
    record_what: Any = "all",
) -> pd.DataFrame:
    """The estimate shown before a long run (module docstring): one calibration forward of ``calibrate`` tokens
    (inside ``record`` when ``record_what``), scaled by the FLOP model and linearly in memory (every attention path
    is O(T) in memory: ``k3core.ops.attention``). Columns: seq_len, seconds, bytes."""
    config = model.config
    device = next(model.parameters()).device
    n_params = sum(p.numel() for p in model.parameters())
    ids = _random_ids(calibrate, config.vocab_size, device)
    _run_forward(model, ids[:, :16], record_what)
    start = time.perf_counter()
    _, grown = peak_rss_growth(lambda: _run_forward(model, ids, record_what))
    seconds = time.perf_counter() - start
    rows = []
    for T in sorted({int(t) for t in lengths}):
        scale = _forward_flops(config, n_params, T) / _forward_flops(config, n_params, calibrate)
        rows.append(dict(seq_len=T, seconds=seconds * scale, bytes=grown * T / calibrate))
    table = pd.DataFrame(rows)
    table.attrs["calibration"] = {"tokens": calibrate, "seconds": seconds, "bytes": int(grown)}
    return table


def machine_memory_bytes() -> int:
    """Physical memory of this machine (``os.sysconf``), for the largest length the app offers."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def largest_length(estimate: pd.DataFrame, budget_bytes: float) -> int:
    """The longest length of an estimate table whose estimated bytes fit the budget (0 if none)."""
    fits = estimate[np.asarray(estimate["bytes"], dtype=float) <= budget_bytes]
    return int(fits["seq_len"].max()) if len(fits) else 0
