"""Long-context diagnostics: how a run behaves far into a text, from a trace that covers every position.

Positions are grouped into the recorder's bins (``trace["position_bins"]``: edges 0, 16, 32, 64, ..., T; bin ``b``
holds positions ``edges[b] <= t < edges[b + 1]``), which suit a log-position axis. Each table has ``start``,
``stop`` and ``position`` (the bin's geometric centre ``sqrt(max(start, 1) * stop)``, where a log axis draws it).

- Loss by position: ``L_b = mean_{t in b} nll_t`` with its standard error ``std / sqrt(n_b)``, against the run's
  short-context loss ``L_short = mean_{t < n_short} nll_t`` (positions within the training length).
- KDA state over position: ``||S||_F`` and the effective rank ``exp(H(sigma / sum sigma))`` of each head's state at
  chunk ends (``kda.i.state_norm``, ``kda.i.state_rank``), averaged over the batch.
- Decay horizon actually used: per bin, head and key channel the mean log decay ``gbar``; the channel's horizon
  is the half-life ``ln 2 / (-gbar)`` (``analysis.metrics.kda_memory.half_life``); the head's is the median over
  channels.
- MLA attention over position: per bin the mean causal-normalised entropy ``H_i / log(i + 1)`` (query 0 skipped)
  and the mean sink mass ``A_i0`` (the attention a query puts on the first token).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.metrics import attention as at
from analysis.metrics.kda_memory import half_life
from analysis.metrics.tidy import tidy
from analysis.runs.missing_data import MissingTraceData
from k3core.interp.attention_stats import position_bins
from k3core.interp.trace import Trace, names

DEFAULT_SHORT_CONTEXT = 256  # the sample checkpoints' training length


def bin_edges(trace: Trace, length: int | None = None) -> np.ndarray:
    """The trace's position-bin edges (``position_bins``), or those of ``length`` tokens for older traces."""
    if names.POSITION_BINS in trace:
        return np.asarray(trace[names.POSITION_BINS], dtype=np.int64)
    if length is None:
        length = int(np.asarray(trace[names.TOKENS]).shape[-1])
    return np.asarray(position_bins(length), dtype=np.int64)


def bin_frame(edges: np.ndarray) -> pd.DataFrame:
    """One row per bin: bin, start, stop, position = sqrt(max(start, 1) * stop) (the centre on a log axis)."""
    start, stop = np.asarray(edges[:-1]), np.asarray(edges[1:])
    return pd.DataFrame(
        {"bin": np.arange(len(start)), "start": start, "stop": stop, "position": np.sqrt(np.maximum(start, 1) * stop)}
    )


def bin_means(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """``mean_{edges[b] <= t < edges[b + 1]} values[..., t]`` over the last axis, NaNs ignored; [..., bins]."""
    values = np.asarray(values, dtype=np.float64)
    out = np.full((*values.shape[:-1], len(edges) - 1), np.nan)
    for b, (s, e) in enumerate(zip(edges[:-1], edges[1:])):
        part = values[..., s:e]
        if part.shape[-1] and np.isfinite(part).any():
            out[..., b] = np.nanmean(part, axis=-1)
    return out


def short_context_loss(nll: np.ndarray, short: int) -> float:
    """``L_short = mean_{t < short} nll_t`` over the batch (the run's loss within its training length)."""
    nll = np.asarray(nll, dtype=np.float64)
    return float(np.nanmean(nll[..., :short])) if nll.shape[-1] else float("nan")


def loss_by_position_table(trace: Trace, short: int = DEFAULT_SHORT_CONTEXT) -> pd.DataFrame:
    """Mean next-token loss per position bin. Columns: bin, start, stop, position, loss, sem, tokens.

    ``sem = std / sqrt(n)`` over the bin's (sequence, position) losses; ``attrs["short_context_loss"]`` is
    ``L_short`` over positions ``< short`` and ``attrs["short_context"] = short``.
    """
    nll = trace.get(names.TOKEN_NLL)
    if nll is None:
        raise MissingTraceData("no per-token loss in this trace (token_nll): record with 'loss' and labels")
    nll = np.asarray(nll, dtype=np.float64)  # [batch, token]
    edges = bin_edges(trace, nll.shape[-1])
    edges = edges[edges <= nll.shape[-1]]
    table = bin_frame(edges)
    table["loss"] = bin_means(nll, edges).mean(0) if nll.shape[0] > 1 else bin_means(nll[0], edges)
    counts = [np.isfinite(nll[:, s:e]).sum() for s, e in zip(edges[:-1], edges[1:])]
    sds = [np.nanstd(nll[:, s:e]) if n > 1 else np.nan for n, (s, e) in zip(counts, zip(edges[:-1], edges[1:]))]
    table["tokens"] = counts
    table["sem"] = np.asarray(sds) / np.sqrt(np.maximum(counts, 1))
    table = tidy(table, keys=["bin"], value="loss")
    table.attrs["short_context"] = int(short)
    table.attrs["short_context_loss"] = short_context_loss(nll, short)
    return table


def kda_state_by_position_table(trace: Trace) -> pd.DataFrame:
    """Per KDA layer, head and chunk end: ``||S||_F`` and effective rank (mean over the batch).

    Columns: layer, head, token (positions the state has read), state_norm, state_rank (NaN for traces that
    predate ``kda.i.state_rank``).
    """
    frames = []
    for i in trace.layer_indices("kda"):
        if names.kda_state_norm(i) not in trace:
            continue
        norm = np.asarray(trace[names.kda_state_norm(i)], dtype=np.float64).mean(0)  # [step, head]
        rank_arr = trace.get(names.kda_state_rank(i))
        rank = np.asarray(rank_arr, dtype=np.float64).mean(0) if rank_arr is not None else np.full_like(norm, np.nan)
        steps = np.asarray(trace.get(names.kda_state_steps(i), np.arange(1, norm.shape[0] + 1)))
        S, H = norm.shape
        frames.append(
            pd.DataFrame(
                {
                    "layer": i,
                    "head": np.tile(np.arange(H), S),
                    "token": np.repeat(steps, H),
                    "state_norm": norm.ravel(),
                    "state_rank": rank.ravel(),
                }
            )
        )
    if not frames:
        raise MissingTraceData("no KDA state norms in this trace (kda.i.state_norm): record with 'kda'")
    return tidy(pd.concat(frames, ignore_index=True), keys=["layer", "head", "token"], value="state_norm")


def decay_horizon_table(trace: Trace) -> pd.DataFrame:
    """Per KDA layer, head and position bin: the median over key channels of ``ln 2 / (-gbar)`` (tokens), with
    ``gbar`` the channel's mean log decay in the bin (``kda.i.g_bins``; older traces: from ``kda.i.g``).

    Columns: layer, head, bin, start, stop, position, horizon (inf when every channel keeps everything).
    """
    frames = []
    for i in trace.layer_indices("kda"):
        if names.kda_g_bins(i) in trace:
            gbar = np.asarray(trace[names.kda_g_bins(i)], dtype=np.float64).mean(0)  # [bin, head, channel]
            edges = bin_edges(trace)
        elif names.kda_g(i) in trace:
            g = np.asarray(trace[names.kda_g(i)], dtype=np.float64)  # [batch, token, head, channel]
            edges = np.asarray(position_bins(g.shape[1]))
            gbar = np.moveaxis(bin_means(np.moveaxis(g, 1, -1), edges), -1, 1).mean(0)
        else:
            continue
        horizon = np.median(half_life(np.minimum(gbar, 0.0)), axis=-1)  # [bin, head]
        bins = bin_frame(edges)
        B, H = horizon.shape
        frame = bins.loc[np.repeat(np.arange(B), H)].reset_index(drop=True)
        frame.insert(0, "head", np.tile(np.arange(H), B))
        frame.insert(0, "layer", i)
        frame["horizon"] = horizon.ravel()
        frames.append(frame)
    if not frames:
        raise MissingTraceData("no KDA decays in this trace (kda.i.g_bins / kda.i.g): record with 'kda'")
    return tidy(pd.concat(frames, ignore_index=True), keys=["layer", "head", "bin"], value="horizon")


def mla_by_position_table(trace: Trace) -> pd.DataFrame:
    """Per MLA layer, head and position bin: mean ``H_i / log(i + 1)`` (query 0 skipped) and mean sink mass
    ``A_i0`` over the bin's queries and the batch (``analysis.metrics.attention.attention_statistics``).

    Columns: layer, head, bin, start, stop, position, entropy_norm, sink_mass.
    """
    frames = []
    for i in at.statistic_layers(trace):
        stats = at.attention_statistics(trace, i)
        T = stats["entropy"].shape[-1]
        edges = bin_edges(trace, T)
        edges = edges[edges <= T]
        ent = bin_means(at.causal_normalised_entropy(stats["entropy"]), edges).mean(0)  # [head, bin]
        sink = bin_means(stats["sink"], edges).mean(0)
        H, B = ent.shape
        frame = bin_frame(edges).loc[np.tile(np.arange(B), H)].reset_index(drop=True)
        frame.insert(0, "head", np.repeat(np.arange(H), B))
        frame.insert(0, "layer", i)
        frame["entropy_norm"] = ent.ravel()
        frame["sink_mass"] = sink.ravel()
        frames.append(frame)
    if not frames:
        raise MissingTraceData("no MLA attention statistics in this trace: record with 'mla' (no MLA layer?)")
    return tidy(pd.concat(frames, ignore_index=True), keys=["layer", "head", "bin"], value="entropy_norm")
