"""Weight-only diagnostics: what a checkpoint learned, from its small tensors, without building the model.

The tensors that describe K3's learned depth, decay and routing are tiny next to the experts: the KDA
gate's ``A_log`` and ``dt_bias``, the AttnRes pseudo-queries, the router selection biases, the norm
scales. ``read_weight_summary(path)`` reads the safetensors headers (parameter layout by depth comes
from the shapes alone) and then only those tensors, one at a time, so a 5 TB checkpoint answers in
seconds on a laptop. ``experts=True`` additionally streams every routed expert matrix for per-expert
weight norms (that reads nearly the whole checkpoint; ``expert_bytes`` says how much first).

Everything below ``summarize_values`` is a small pure function on numpy arrays; the readers only decide
which tensors to fetch. A loaded model gives the same summary through ``StateDictSource`` (the app and
the report use it for runs that are loaded anyway).

The numbers (formulas in each function's docstring):

- KDA resting decay: the gate with zero input, g0 = lb * sigmoid(exp(A_log) * dt_bias) (lower-bound gate,
  K3) or g0 = -exp(A_log) * softplus(dt_bias) (softplus gate, Kimi Linear), one value per head and
  channel; half-life = ln 2 / (-g0) tokens (the state's memory of that channel halves every half-life);
- AttnRes pseudo-query norm ||w|| per site (attention, MLP, output mix; 0 = uniform mix over depth);
- scale/bias residual: per depth and site the learned scale and bias (mean and std over channels);
- router selection bias e_bias per layer x expert, its spread per layer, router weight row norms;
- norm weights (input, post-attention, KDA output norm, latent expert norm): mean and max per layer;
- parameters by depth and kind, from the header shapes;
- with experts: Frobenius norm of each routed expert (w1, w2, w3 together) per layer x expert.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from k3core.config import K3Config

LN2 = math.log(2.0)
EXPERT_RE = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
KINDS = ("KDA", "MLA", "dense FFN", "routed experts", "shared experts", "norms/other", "embedding / LM head")
NORMS = {  # label -> tensor suffix inside a decoder layer
    "input": "input_layernorm.weight",
    "post_attention": "post_attention_layernorm.weight",
    "kda_o_norm": "self_attn.o_norm.weight",
    "latent_expert_norm": "block_sparse_moe.routed_expert_norm.weight",
}
Progress = Callable[[int, int], None]  # (bytes read so far, bytes this summary will read)


# ============================================================================ tensor sources
@dataclass(frozen=True)
class TensorMeta:
    """Name, dtype (safetensors spelling: "BF16", "F32", ...), shape and byte size of one tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    numel: int


_TORCH_DTYPES = {
    "torch.bfloat16": "BF16",
    "torch.float32": "F32",
    "torch.float16": "F16",
    "torch.float64": "F64",
    "torch.int64": "I64",
    "torch.int32": "I32",
    "torch.uint8": "U8",
    "torch.int8": "I8",
    "torch.bool": "BOOL",
    "torch.float8_e4m3fn": "F8_E4M3",
    "torch.float8_e5m2": "F8_E5M2",
}


class OffloadedWeights(ValueError):
    """A loaded model's tensor holds no values here (meta device: offloaded to disk, or shapes only)."""


class StateDictSource:
    """A loaded model (or a plain dict of tensors) seen through the reader's interface: ``tensors``
    (name -> meta), ``read(name)``, ``bytes_read``, ``bytes_total``, ``config``, ``skipped``.

    A tied LM head is left out, as ``save_pretrained`` leaves it out of the files."""

    def __init__(self, state: Any, config: K3Config | None = None) -> None:
        if hasattr(state, "state_dict"):
            config = config if config is not None else getattr(state, "config", None)
            state = state.state_dict()
        self._state = dict(state)
        if config is not None and config.tie_word_embeddings:
            self._state.pop("lm_head.weight", None)
        self.config = config
        self.skipped: list[str] = []
        self.tensors = {
            k: TensorMeta(
                k,
                _TORCH_DTYPES.get(str(v.dtype), str(v.dtype)),
                tuple(v.shape),
                v.numel() * v.element_size(),
                v.numel(),
            )
            for k, v in self._state.items()
        }
        self.bytes_total = sum(m.nbytes for m in self.tensors.values())
        self.bytes_read = 0

    def read(self, name: str) -> Any:
        t = self._state[name].detach()
        if t.is_meta:
            raise OffloadedWeights(
                f"{name} has no values in memory (offloaded or shapes only): read the weights "
                f"from the checkpoint folder instead (read_weight_summary)"
            )
        self.bytes_read += self.tensors[name].nbytes
        return t.to("cpu")


def open_source(path: str | Path) -> Any:
    """A checkpoint folder (or one .safetensors file) opened header-only (``k3core.checkpoint_files``);
    config.json is read when present (without it the KDA gate form is unknown, everything else works).

    Raises ``k3core.checkpoint_files.CheckpointError`` for anything wrong with it."""
    from k3core.checkpoint_files import CheckpointFiles

    return CheckpointFiles.open(path, require_config=False)


def _numel(meta: Any) -> int:
    n = getattr(meta, "numel", None)
    return int(n) if n is not None else int(np.prod(meta.shape, dtype=np.int64))


def _to_numpy(t: Any) -> np.ndarray:
    """A tensor as float64 numpy (bf16 has no numpy dtype: go through torch's float64)."""
    if isinstance(t, np.ndarray):
        return t.astype(np.float64)
    return t.detach().to("cpu").double().numpy()


# ============================================================================ layout from names
def layer_of(name: str) -> tuple[int | None, str]:
    """(decoder layer index, name inside the layer) for ``model.layers.i.<rest>``; (None, name) otherwise."""
    # str methods, not a regex: this runs for every tensor name (250k for Kimi K3), several times
    if not name.startswith("model.layers."):
        return None, name
    idx, _, rest = name[13:].partition(".")
    return (int(idx), rest) if idx.isdigit() and rest else (None, name)


def num_layers_of(names: Iterable[str], config: K3Config | None = None) -> int:
    """Decoder layer count: the config's, else one more than the largest ``model.layers.i`` index."""
    if config is not None:
        return int(config.num_hidden_layers)
    idx = [i for i, _ in map(layer_of, names) if i is not None]
    return max(idx) + 1 if idx else 0


def layer_structure(names: Iterable[str], config: K3Config | None = None) -> pd.DataFrame:
    """Per decoder layer: mixer ("kda" if it has ``self_attn.A_log`` / ``dt_bias``, "mla" otherwise) and
    ffn ("moe" if it has a router ``block_sparse_moe.gate.weight``, else "dense"). Without any
    ``self_attn`` tensor in a layer the config decides."""
    names = list(names)
    n = num_layers_of(names, config)
    kda, mla, moe = set(), set(), set()
    for name in names:
        i, rest = layer_of(name)
        if i is None:
            continue
        if rest in ("self_attn.A_log", "self_attn.dt_bias"):
            kda.add(i)
        elif rest.startswith("self_attn."):
            mla.add(i)
        if rest == "block_sparse_moe.gate.weight":
            moe.add(i)
    rows = []
    for i in range(n):
        if i in kda:
            mixer = "kda"
        elif i in mla or config is None:
            mixer = "mla"
        else:
            mixer = "mla" if config.is_mla_layer(i) else "kda"
        rows.append({"layer": i, "mixer": mixer, "ffn": "moe" if i in moe else "dense"})
    return pd.DataFrame(rows, columns=["layer", "mixer", "ffn"])


def tensor_kind(name: str, mixer: str | None = None) -> str:
    """Which part of the model a (canonical) tensor belongs to, for parameters by depth and kind:

    - "KDA" / "MLA": ``self_attn.*`` of a KDA / MLA layer;
    - "dense FFN": ``mlp.*`` (and transformers' dense ``block_sparse_moe.{gate,up,down}_proj``);
    - "routed experts": the routed path of a MoE layer: router, selection bias, latent down/up projections
      and norm, and the experts;
    - "shared experts": ``block_sparse_moe.shared_experts.*``;
    - "norms/other": layer norms, AttnRes pseudo-queries and key norms, scale/bias residuals, final norm
      and the output mix;
    - "embedding / LM head": ``model.embed_tokens``, ``lm_head``.
    """
    return _kind(layer_of(name)[1], mixer)


_DENSE_UNDER_MOE = frozenset(f"block_sparse_moe.{p}_proj.weight" for p in ("gate", "up", "down"))


def _kind(rest: str, mixer: str | None) -> str:
    """tensor_kind from the name inside the layer (the whole name outside layers)."""
    if rest.startswith("model.embed_tokens") or rest.startswith("lm_head"):
        return "embedding / LM head"
    if rest.startswith("self_attn."):
        return "MLA" if mixer == "mla" else "KDA"
    if rest.startswith("mlp.") or rest in _DENSE_UNDER_MOE:
        return "dense FFN"
    if rest.startswith("block_sparse_moe.shared_experts."):
        return "shared experts"
    if rest.startswith("block_sparse_moe."):
        return "routed experts"
    return "norms/other"


def params_by_depth(shapes: Mapping[str, Any], structure: pd.DataFrame) -> pd.DataFrame:
    """Parameters (elements, from header shapes) per depth and kind. Columns: layer (-1 = embedding,
    n = output: LM head, final norm, output mix), depth ("embedding", "L0".., "output"), kind, params.
    Only (depth, kind) pairs with parameters appear."""
    mixers = dict(zip(structure["layer"], structure["mixer"]))
    n = len(structure)
    totals: dict[tuple[int, str], int] = {}
    for name, meta in shapes.items():
        i, rest = layer_of(name)
        if i is None:
            i = -1 if name.startswith("model.embed_tokens") else n
        kind = _kind(rest, mixers.get(i))
        totals[(i, kind)] = totals.get((i, kind), 0) + _numel(meta)
    rows = [
        {"layer": i, "depth": _depth_label(i, n), "kind": kind, "params": p}
        for (i, kind), p in sorted(totals.items(), key=lambda kv: (kv[0][0], KINDS.index(kv[0][1])))
    ]
    df = pd.DataFrame(rows, columns=["layer", "depth", "kind", "params"])
    df.attrs["keys"] = ["layer", "depth", "kind"]
    return df


def _depth_label(i: int, n: int) -> str:
    return "embedding" if i < 0 else ("output" if i >= n else f"L{i}")


# ============================================================================ KDA resting decay
def live_a_log(a_log: np.ndarray, num_heads: int) -> np.ndarray:
    """A_log as one value per live head. Accepts [H], Kimi Linear's [1, 1, H, 1] and the real K3
    checkpoint's zero padding (128 entries, the first H live); fewer than H entries is an error."""
    flat = np.asarray(a_log, dtype=np.float64).reshape(-1)
    if flat.size < num_heads:
        raise ValueError(f"A_log has {flat.size} entries, fewer than the {num_heads} KDA heads")
    return flat[:num_heads]


def resting_decay(
    a_log: np.ndarray, dt_bias: np.ndarray, num_heads: int, gate: str = "lower_bound", lower_bound: float = -5.0
) -> np.ndarray:
    """The KDA decay gate with zero input (z = 0), per head and channel, [H, d] float64:

        lower-bound gate (K3):         g0 = lb * sigmoid(exp(A_log[h]) * dt_bias[h, c])
        softplus gate (Kimi Linear):   g0 = -exp(A_log[h]) * softplus(dt_bias[h, c])

    A_log has one value per head (broadcast over that head's d channels, padding after the live heads
    ignored); dt_bias has H * d values. g0 = log alpha0 <= 0 is the log decay per token at rest."""
    a = np.exp(live_a_log(a_log, num_heads))[:, None]
    dt = np.asarray(dt_bias, dtype=np.float64).reshape(num_heads, -1)
    if gate == "lower_bound":
        x = a * dt
        # sigmoid written to avoid overflow of exp for either sign of x
        sig = np.where(x >= 0, 1.0 / (1.0 + np.exp(-np.abs(x))), np.exp(-np.abs(x)) / (1.0 + np.exp(-np.abs(x))))
        return float(lower_bound) * sig
    if gate == "softplus":
        return -a * np.logaddexp(0.0, dt)
    raise ValueError(f"unknown KDA gate {gate!r} (expected 'lower_bound' or 'softplus')")


def half_life(g0: np.ndarray) -> np.ndarray:
    """Tokens until a channel's memory halves at rest: alpha0^n = 1/2 with alpha0 = exp(g0), so
    n = ln 2 / (-g0). g0 = 0 (no forgetting) gives inf."""
    g0 = np.asarray(g0, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return np.where(g0 < 0, LN2 / np.where(g0 < 0, -g0, 1.0), np.inf)


def spread(x: np.ndarray) -> dict[str, float]:
    """Median and 10th / 90th percentiles over all entries (numpy's linear interpolation; with infinite
    entries the nearest rank, since interpolating between inf and inf is undefined)."""
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    method = "linear" if np.isfinite(x).all() else "nearest"
    p10, med, p90 = np.percentile(x, [10, 50, 90], method=method)
    return {"median": float(med), "p10": float(p10), "p90": float(p90)}


def kda_tables(
    values: Mapping[str, np.ndarray],
    structure: pd.DataFrame,
    config: K3Config | None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per layer, per layer x head) resting-decay tables of the KDA layers.

    Layer columns: layer, heads, g0_mean, half_life_median, half_life_p10, half_life_p90 (over all the
    layer's H*d channels). Head columns: layer, head, A_log, g0_mean, half_life_median/p10/p90 (over the
    head's d channels). The head count is the config's (``kda_num_heads``), else dt_bias size / o_norm size.
    Without a config the gate form is unknown and the tables are empty."""
    layer_rows, head_rows = [], []
    if config is not None:
        for i in structure.loc[structure["mixer"] == "kda", "layer"]:
            a = values.get(f"model.layers.{i}.self_attn.A_log")
            dt = values.get(f"model.layers.{i}.self_attn.dt_bias")
            if a is None or dt is None:
                continue
            heads = int(config.kda_num_heads)
            g0 = resting_decay(a, dt, heads, config.kda_gate, config.kda_gate_lower_bound)
            hl = half_life(g0)
            s = spread(hl)
            layer_rows.append(
                {
                    "layer": int(i),
                    "heads": heads,
                    "g0_mean": float(g0.mean()),
                    "half_life_median": s["median"],
                    "half_life_p10": s["p10"],
                    "half_life_p90": s["p90"],
                }
            )
            a_live = live_a_log(a, heads)
            for h in range(heads):
                sh = spread(hl[h])
                head_rows.append(
                    {
                        "layer": int(i),
                        "head": h,
                        "A_log": float(a_live[h]),
                        "g0_mean": float(g0[h].mean()),
                        "half_life_median": sh["median"],
                        "half_life_p10": sh["p10"],
                        "half_life_p90": sh["p90"],
                    }
                )
    layers = pd.DataFrame(
        layer_rows, columns=["layer", "heads", "g0_mean", "half_life_median", "half_life_p10", "half_life_p90"]
    )
    heads = pd.DataFrame(
        head_rows, columns=["layer", "head", "A_log", "g0_mean", "half_life_median", "half_life_p10", "half_life_p90"]
    )
    layers.attrs["keys"] = ["layer"]
    heads.attrs["keys"] = ["layer", "head"]
    return layers, heads


# ============================================================================ AttnRes, scale/bias, norms
def vector_norm(x: np.ndarray) -> float:
    """Euclidean norm sqrt(sum x^2) over every entry, in float64."""
    return float(np.sqrt(np.sum(np.square(np.asarray(x, dtype=np.float64)))))


def query_norm_table(values: Mapping[str, np.ndarray], num_layers: int) -> pd.DataFrame:
    """AttnRes pseudo-query norm ||w|| per site. Columns: layer (num_layers for the output mix), site
    ("attn" | "mlp" | "output"), depth (plot label), query_norm. Empty for runs without AttnRes.
    (With Block AttnRes the first layer's attention-site query is never used: its bank is empty.)"""
    rows = []
    for i in range(num_layers):
        for site, key in (("attn", "self_attention_res_proj"), ("mlp", "mlp_res_proj")):
            w = values.get(f"model.layers.{i}.{key}.weight")
            if w is not None:
                rows.append({"layer": i, "site": site, "depth": f"L{i} {site}", "query_norm": vector_norm(w)})
    w = values.get("model.output_attn_res_proj.weight")
    if w is not None:
        rows.append({"layer": num_layers, "site": "output", "depth": "output", "query_norm": vector_norm(w)})
    df = pd.DataFrame(rows, columns=["layer", "site", "depth", "query_norm"])
    df.attrs["keys"] = ["layer", "site", "depth"]
    return df


def scale_bias_table(values: Mapping[str, np.ndarray], num_layers: int) -> pd.DataFrame:
    """Scale/bias residual (h = h + scale * f(h) + bias) per layer and site: scale and bias mean and
    population std over channels. Columns: layer, site, scale_mean, scale_std, bias_mean, bias_std."""
    rows = []
    for i in range(num_layers):
        for site, key in (("attn", "self_attention_res"), ("mlp", "mlp_res")):
            scale = values.get(f"model.layers.{i}.{key}_scale")
            bias = values.get(f"model.layers.{i}.{key}_bias")
            if scale is None or bias is None:
                continue
            scale, bias = np.asarray(scale, np.float64), np.asarray(bias, np.float64)
            rows.append(
                {
                    "layer": i,
                    "site": site,
                    "scale_mean": float(scale.mean()),
                    "scale_std": float(scale.std()),
                    "bias_mean": float(bias.mean()),
                    "bias_std": float(bias.std()),
                }
            )
    df = pd.DataFrame(rows, columns=["layer", "site", "scale_mean", "scale_std", "bias_mean", "bias_std"])
    df.attrs["keys"] = ["layer", "site"]
    return df


def norm_table(values: Mapping[str, np.ndarray], num_layers: int) -> pd.DataFrame:
    """RMSNorm weights by depth: mean and max of each norm's weight vector. Columns: layer, norm
    ("input", "post_attention", "kda_o_norm", "latent_expert_norm"), mean, max."""
    rows = []
    for i in range(num_layers):
        for label, suffix in NORMS.items():
            w = values.get(f"model.layers.{i}.{suffix}")
            if w is not None:
                w = np.asarray(w, np.float64)
                rows.append({"layer": i, "norm": label, "mean": float(w.mean()), "max": float(w.max())})
    df = pd.DataFrame(rows, columns=["layer", "norm", "mean", "max"])
    df.attrs["keys"] = ["layer", "norm"]
    return df


# ============================================================================ router and experts
def router_bias_table(values: Mapping[str, np.ndarray], num_layers: int) -> pd.DataFrame:
    """Router selection bias e_bias per MoE layer and expert (it shifts which experts are chosen,
    top_k(s + e_bias), not their weights). Columns: layer, expert, bias."""
    frames = []
    for i in range(num_layers):
        b = values.get(f"model.layers.{i}.block_sparse_moe.gate.e_score_correction_bias")
        if b is not None:
            b = np.asarray(b, np.float64).reshape(-1)
            frames.append(pd.DataFrame({"layer": i, "expert": np.arange(b.size), "bias": b}))
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["layer", "expert", "bias"])
    df.attrs["keys"] = ["layer", "expert"]
    return df


def bias_stats(bias: np.ndarray) -> dict[str, float]:
    """mean, population std, min and max of one layer's selection biases."""
    b = np.asarray(bias, np.float64).reshape(-1)
    return {"mean": float(b.mean()), "std": float(b.std()), "min": float(b.min()), "max": float(b.max())}


def router_bias_spread(bias: pd.DataFrame) -> pd.DataFrame:
    """Per MoE layer: e_bias mean, std (population), min, max (``bias_stats``)."""
    rows = [
        {"layer": int(layer), **bias_stats(g.sort_values("expert")["bias"].to_numpy())}
        for layer, g in bias.groupby("layer", sort=True)
    ]
    df = pd.DataFrame(rows, columns=["layer", "mean", "std", "min", "max"])
    df.attrs["keys"] = ["layer"]
    return df


def row_norms(matrix: np.ndarray) -> np.ndarray:
    """Euclidean norm of each row: for the router weight W [E, D], ||W_e|| per expert e."""
    m = np.asarray(matrix, np.float64)
    return np.sqrt(np.square(m).sum(axis=1))


def router_norm_table(values: Mapping[str, np.ndarray], num_layers: int) -> pd.DataFrame:
    """Router weight row norm ||W_router[e]|| per MoE layer and expert. Columns: layer, expert, weight_norm.
    (``values`` holds the row norms already: the reader reduces each router matrix as it reads it.)"""
    frames = []
    for i in range(num_layers):
        n = values.get(f"model.layers.{i}.block_sparse_moe.gate.weight")
        if n is not None:
            n = np.asarray(n, np.float64).reshape(-1)
            frames.append(pd.DataFrame({"layer": i, "expert": np.arange(n.size), "weight_norm": n}))
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["layer", "expert", "weight_norm"])
    df.attrs["keys"] = ["layer", "expert"]
    return df


def expert_norm_table(sums: Mapping[str, float], num_layers: int) -> pd.DataFrame:
    """Per MoE layer and routed expert: Frobenius norms of w1 (gate), w3 (up), w2 (down) and of the three
    together, sqrt(|w1|^2 + |w2|^2 + |w3|^2). ``sums`` maps each expert matrix's name to its sum of squares.
    Columns: layer, expert, w1_norm, w2_norm, w3_norm, norm."""
    acc: dict[tuple[int, int], dict[str, float]] = {}
    for name, sq in sums.items():
        i, rest = layer_of(name)
        m = EXPERT_RE.match(rest) if i is not None else None
        if m:
            acc.setdefault((i, int(m.group(1))), {})[m.group(2)] = float(sq)
    rows = []
    for (i, e), parts in sorted(acc.items()):
        row = {"layer": i, "expert": e}
        for w in ("w1", "w2", "w3"):
            row[f"{w}_norm"] = math.sqrt(parts[w]) if w in parts else float("nan")
        row["norm"] = math.sqrt(sum(parts.values()))
        rows.append(row)
    df = pd.DataFrame(rows, columns=["layer", "expert", "w1_norm", "w2_norm", "w3_norm", "norm"])
    df.attrs["keys"] = ["layer", "expert"]
    return df


# ============================================================================ the summary
@dataclass
class WeightSummary:
    """Everything the weight-only views show, as tidy tables (see each builder for the columns)."""

    label: str
    config: K3Config | None
    total_params: int
    bytes_total: int
    bytes_read: int
    seconds: float
    skipped: list[str]
    structure: pd.DataFrame  # layer, mixer, ffn, params
    params: pd.DataFrame  # params_by_depth
    kda_layers: pd.DataFrame
    kda_heads: pd.DataFrame
    query_norms: pd.DataFrame
    scale_bias: pd.DataFrame
    norms: pd.DataFrame
    router_bias: pd.DataFrame
    router_bias_stats: pd.DataFrame
    router_norms: pd.DataFrame
    expert_norms: pd.DataFrame | None = None  # only with experts=True
    notes: list[str] = field(default_factory=list)
    path: str = ""
    expert_bytes: int = 0  # what experts=True reads on top (``expert_bytes``)

    @property
    def num_layers(self) -> int:
        return len(self.structure)

    def to_json(self) -> dict[str, Any]:
        """The stable ``weights.json`` format (see ``weights_json``)."""
        return weights_json(self)


def small_tensor_names(names: Iterable[str], structure: pd.DataFrame) -> list[str]:
    """The tensors a weight summary reads: KDA A_log / dt_bias, the norms of ``NORMS``, AttnRes
    pseudo-queries, scale/bias residuals, router biases and router weights. Nothing else."""
    wanted_rest = {
        "self_attn.A_log",
        "self_attn.dt_bias",
        "self_attention_res_proj.weight",
        "mlp_res_proj.weight",
        "self_attention_res_scale",
        "self_attention_res_bias",
        "mlp_res_scale",
        "mlp_res_bias",
        "block_sparse_moe.gate.e_score_correction_bias",
        "block_sparse_moe.gate.weight",
        *NORMS.values(),
    }
    out = []
    for name in names:
        i, rest = layer_of(name)
        if (i is not None and rest in wanted_rest) or name == "model.output_attn_res_proj.weight":
            out.append(name)
    return out


def expert_tensor_names(names: Iterable[str]) -> list[str]:
    """Every routed expert matrix (``model.layers.i.block_sparse_moe.experts.E.w{1,2,3}.weight``)."""
    return [n for n in names if (lambda p: p[0] is not None and EXPERT_RE.match(p[1]))(layer_of(n))]


def expert_bytes(source: Any) -> int:
    """Bytes that ``experts=True`` reads on top of the small tensors."""
    return sum(int(source.tensors[n].nbytes) for n in expert_tensor_names(source.tensors))


def _read_order(source: Any, names: list[str]) -> list[str]:
    """Names sorted by (file, offset) when the reader knows them: sequential reads within each shard."""

    def key(n: str) -> tuple[str, int, str]:
        meta = source.tensors[n]
        return (str(getattr(meta, "file", "")), int(getattr(meta, "begin", 0)), n)

    return sorted(names, key=key)


def summarize_source(
    source: Any,
    experts: bool = False,
    progress: Progress | None = None,
    label: str = "",
    path: str = "",
    started: float | None = None,
) -> WeightSummary:
    """Read the small tensors of ``source`` one at a time (router matrices reduced to row norms as they
    arrive; expert matrices to sums of squares) and summarise them. ``progress(done, total)`` in bytes;
    ``started``: the ``time.perf_counter()`` when opening the source began (``seconds`` counts from there)."""
    t0 = time.perf_counter() if started is None else started
    tensors = source.tensors
    config = getattr(source, "config", None)
    structure = layer_structure(tensors, config)
    wanted = _read_order(source, small_tensor_names(tensors, structure))
    expert_names = _read_order(source, expert_tensor_names(tensors)) if experts else []
    total = sum(int(tensors[n].nbytes) for n in wanted + expert_names)
    done = 0
    values: dict[str, np.ndarray] = {}
    sums: dict[str, float] = {}
    notes: list[str] = []
    routers = [n for n in wanted if n.endswith("block_sparse_moe.gate.weight")]
    # The large reads (routers, experts) come last, into outputs allocated before them: a long-lived small
    # array allocated between two 13 MB reads would pin the freed block and grow the heap by a read each time.
    for name in routers:
        values[name] = np.empty(int(tensors[name].shape[0]), dtype=np.float64)
    for name in [n for n in wanted if n not in values] + routers + expert_names:
        arr = source.read(name)
        if name in values:
            _router_row_norms(arr, out=values[name])
        elif experts and EXPERT_RE.match(layer_of(name)[1]):
            sums[name] = _sum_squares(arr, notes)
        else:
            values[name] = _to_numpy(arr)
        del arr
        done += int(tensors[name].nbytes)
        if progress is not None:
            progress(done, total)
    if config is None:
        notes.append("no config.json: KDA gate form unknown, resting decay not computed")
    summary = summarize_values(values, tensors, config, sums if experts else None, notes, structure)
    summary.label = label
    summary.path = path
    summary.skipped = list(getattr(source, "skipped", []))
    summary.bytes_total = int(source.bytes_total)
    summary.bytes_read = int(source.bytes_read)
    summary.expert_bytes = sum(int(tensors[n].nbytes) for n in expert_tensor_names(tensors))
    summary.seconds = time.perf_counter() - t0
    return summary


def _router_row_norms(t: Any, out: np.ndarray | None = None) -> np.ndarray:
    """Row norms of a router weight (K3: 896 x 7168): float32 values (exact for bf16 / fp32 storage),
    products and sums in float64 (``row_norms``)."""
    x = t if isinstance(t, np.ndarray) else t.reshape(t.shape[0], -1).float().numpy()
    x = x.reshape(x.shape[0], -1)
    out = np.empty(x.shape[0], dtype=np.float64) if out is None else out
    np.einsum("ij,ij->i", x, x, dtype=np.float64, out=out)
    return np.sqrt(out, out=out)


def _sum_squares(t: Any, notes: list[str]) -> float:
    """Sum of squares of an expert matrix, float32 values with float64 products and sums (NaN with a note
    for packed / integer dtypes, whose elements are not the weights)."""
    if isinstance(t, np.ndarray):
        x = t.astype(np.float32, copy=False).reshape(-1)
    elif not t.is_floating_point():
        if not any("packed" in n for n in notes):
            notes.append(f"expert matrices stored as {t.dtype} (packed/quantised): expert norms not computed")
        return float("nan")
    else:
        x = t.reshape(-1).float().numpy()
    return float(np.einsum("i,i->", x, x, dtype=np.float64))


def summarize_values(
    values: Mapping[str, np.ndarray],
    shapes: Mapping[str, Any],
    config: K3Config | None,
    expert_sums: Mapping[str, float] | None = None,
    notes: list[str] | None = None,
    structure: pd.DataFrame | None = None,
) -> WeightSummary:
    """A WeightSummary from plain arrays: ``values`` maps canonical tensor names to the tensors of
    ``small_tensor_names`` (router weights as their row norms), ``shapes`` every tensor's meta (shape,
    nbytes); ``expert_sums`` the sum of squares of each expert matrix (None: no expert norms); ``structure``
    the ``layer_structure`` when the caller has it already."""
    structure = layer_structure(shapes, config) if structure is None else structure[["layer", "mixer", "ffn"]]
    n = len(structure)
    params = params_by_depth(shapes, structure)
    layer_params = params[(params["layer"] >= 0) & (params["layer"] < n)].groupby("layer")["params"].sum()
    structure = structure.assign(params=[int(layer_params.get(i, 0)) for i in structure["layer"]])
    structure.attrs["keys"] = ["layer"]
    kda_layers, kda_heads = kda_tables(values, structure, config)
    bias = router_bias_table(values, n)
    return WeightSummary(
        label="",
        config=config,
        total_params=int(sum(_numel(m) for m in shapes.values())),
        bytes_total=int(sum(int(getattr(m, "nbytes", 0)) for m in shapes.values())),
        bytes_read=0,
        seconds=0.0,
        skipped=[],
        structure=structure,
        params=params,
        kda_layers=kda_layers,
        kda_heads=kda_heads,
        query_norms=query_norm_table(values, n),
        scale_bias=scale_bias_table(values, n),
        norms=norm_table(values, n),
        router_bias=bias,
        router_bias_stats=router_bias_spread(bias),
        router_norms=router_norm_table(values, n),
        expert_norms=expert_norm_table(expert_sums, n) if expert_sums is not None else None,
        notes=list(notes or []),
    )


def read_weight_summary(
    path: str | Path,
    experts: bool = False,
    progress: Progress | None = None,
) -> WeightSummary:
    """Weight-only summary of a checkpoint folder: headers, then only the small tensors (plus every expert
    matrix with ``experts=True``), one at a time; never builds the model. Raises CheckpointError."""
    started = time.perf_counter()
    source = open_source(path)
    p = Path(path)
    label = p.resolve().name or str(p)
    return summarize_source(source, experts=experts, progress=progress, label=label, path=str(p), started=started)


def summary_of_model(model: Any, label: str = "run") -> WeightSummary:
    """The same summary from a loaded model's parameters (``StateDictSource``)."""
    return summarize_source(StateDictSource(model), experts=False, label=label)


# ============================================================================ weights.json
def _finite_or_none(x: Any) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def weights_json(summary: WeightSummary) -> dict[str, Any]:
    """The ``weights.json`` document (stable format; non-finite numbers become null):

    {"total_params": int, "bytes_total": int, "bytes_read": int, "seconds": float,
     "skipped_tensors": [str], "output_attn_res_query_norm": float|null,
     "layers": [{"index": int (0-based), "mixer": "kda"|"mla", "ffn": "dense"|"moe", "params": int,
                 "kda_half_life": {"median": float, "p10": float, "p90": float}|null,
                 "attn_res_query_norm": float|null, "mlp_res_query_norm": float|null,
                 "router_bias": {"mean": float, "std": float, "min": float, "max": float}|null}]}
    """
    qn = summary.query_norms
    qmap = {(int(r.layer), r.site): float(r.query_norm) for r in qn.itertuples()}
    kda = {int(r.layer): r for r in summary.kda_layers.itertuples()}
    rb = {int(r.layer): r for r in summary.router_bias_stats.itertuples()}
    layers = []
    for r in summary.structure.itertuples():
        i = int(r.layer)
        k = kda.get(i)
        b = rb.get(i)
        layers.append(
            {
                "index": i,
                "mixer": r.mixer,
                "ffn": r.ffn,
                "params": int(r.params),
                "kda_half_life": None
                if k is None
                else {
                    "median": _finite_or_none(k.half_life_median),
                    "p10": _finite_or_none(k.half_life_p10),
                    "p90": _finite_or_none(k.half_life_p90),
                },
                "attn_res_query_norm": _finite_or_none(qmap.get((i, "attn"))),
                "mlp_res_query_norm": _finite_or_none(qmap.get((i, "mlp"))),
                "router_bias": None
                if b is None
                else {
                    "mean": _finite_or_none(b.mean),
                    "std": _finite_or_none(b.std),
                    "min": _finite_or_none(b.min),
                    "max": _finite_or_none(b.max),
                },
            }
        )
    return {
        "total_params": int(summary.total_params),
        "bytes_total": int(summary.bytes_total),
        "bytes_read": int(summary.bytes_read),
        "seconds": float(summary.seconds),
        "skipped_tensors": list(summary.skipped),
        "output_attn_res_query_norm": _finite_or_none(qmap.get((summary.num_layers, "output"))),
        "layers": layers,
    }


def write_weights_json(summary: WeightSummary, path: str | Path) -> Path:
    """Write ``weights_json(summary)`` (indented, UTF-8)."""
    path = Path(path)
    path.write_text(json.dumps(weights_json(summary), indent=1) + "\n")
    return path


# ============================================================================ output folder
def weight_views() -> list:
    """The registered views of the "weights" section (analysis.figures.weights.VIEWS)."""
    from analysis.figures.weights import VIEWS

    return list(VIEWS)


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover


def write_outputs(summary: WeightSummary, out_dir: str | Path, static: bool = True) -> dict[str, Any]:
    """Write ``weights.json``, every applicable weights view under ``figures/`` (offline HTML, CSV and, when
    ``static`` and Chromium are available, PNG and SVG) and ``index.html`` (all figures on one offline page).

    Returns {"json": Path, "index": Path, "figures": {view key: {format: Path or message}},
    "not_applicable": {view key: reason}, "errors": {view key: message}}."""
    import html as _html

    from analysis.export import export_many
    from analysis.views import AnalysisContext, NotApplicable

    out = Path(out_dir)
    (out / "figures").mkdir(parents=True, exist_ok=True)
    json_path = write_weights_json(summary, out / "weights.json")
    ctx = AnalysisContext(trace=None, config=summary.config, label=summary.label, weights=summary)
    built, skipped, errors = [], {}, {}
    for view in weight_views():
        try:
            fig, df = view.build(ctx)
        except NotApplicable as exc:
            skipped[view.key] = str(exc)
            continue
        except Exception as exc:  # noqa: BLE001 - one broken figure must not lose the others
            errors[view.key] = f"{type(exc).__name__}: {exc}"
            continue
        built.append((view, fig, df))
    formats = ("html", "csv", "png", "svg") if static else ("html", "csv")
    files = export_many([(fig, df, view.key) for view, fig, df in built], out / "figures", formats=formats)

    doc = weights_json(summary)
    rows = [
        ("checkpoint", summary.path or summary.label),
        ("parameters (text model, from headers)", f"{summary.total_params:,}"),
        ("declared bytes", f"{summary.bytes_total:,} ({human_bytes(summary.bytes_total)})"),
        (
            "bytes read",
            f"{summary.bytes_read:,} ({human_bytes(summary.bytes_read)}, "
            f"{100 * summary.bytes_read / max(summary.bytes_total, 1):.4f}% of declared)",
        ),
        ("seconds", f"{summary.seconds:.2f}"),
        (
            "decoder layers",
            f"{summary.num_layers} ({(summary.structure['mixer'] == 'kda').sum()} KDA, "
            f"{(summary.structure['mixer'] == 'mla').sum()} MLA; "
            f"{(summary.structure['ffn'] == 'moe').sum()} MoE)",
        ),
        ("skipped tensors (not the text model)", str(len(summary.skipped))),
        (
            "output-mix pseudo-query norm",
            "—" if doc["output_attn_res_query_norm"] is None else f"{doc['output_attn_res_query_norm']:.4g}",
        ),
    ]
    body = [
        "<h1>Weight-only diagnostics: " + _html.escape(summary.label) + "</h1>",
        "<table>"
        + "".join(f"<tr><th>{_html.escape(k)}</th><td>{_html.escape(v)}</td></tr>" for k, v in rows)
        + "</table>",
    ]
    for note in summary.notes:
        body.append(f"<p class='note'>{_html.escape(note)}</p>")
    body.append(
        "<p>Data: <a href='weights.json'>weights.json</a>. Each figure below also has its own files "
        "in <code>figures/</code>.</p>"
    )
    first = True
    for view, fig, _ in built:
        links = " · ".join(
            f"<a href='figures/{p.name}'>{fmt.upper()}</a>"
            if isinstance(p, Path)
            else f"<span title='{_html.escape(str(p))}'>{fmt.upper()}: not written</span>"
            for fmt, p in files.get(view.key, {}).items()
        )
        body.append(
            f"<section id='{view.key}'><h2>{_html.escape(view.title)}</h2>"
            f"<p class='caption'>{_html.escape(view.description)}</p>"
            + fig.to_html(full_html=False, include_plotlyjs=first, config={"displaylogo": False})
            + f"<p class='files'>{links}</p></section>"
        )
        first = False
    for key, reason in skipped.items():
        body.append(f"<p class='note'>{_html.escape(key)}: not applicable: {_html.escape(reason)}</p>")
    for key, message in errors.items():
        body.append(f"<p class='error'>{_html.escape(key)}: failed: {_html.escape(message)}</p>")
    style = (
        "body{font-family:Inter,Helvetica,Arial,sans-serif;max-width:1200px;margin:2em auto;color:#222}"
        "table{border-collapse:collapse}th,td{padding:3px 10px;border-bottom:1px solid #ddd;text-align:left}"
        ".caption{color:#444}.note{color:#666}.error{color:#b00}.files{font-size:90%}"
    )
    index = out / "index.html"
    index.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>k3lab weights: "
        f"{_html.escape(summary.label)}</title><style>{style}</style></head><body>"
        + "\n".join(body)
        + "</body></html>\n",
        encoding="utf-8",
    )
    return {"json": json_path, "index": index, "figures": files, "not_applicable": skipped, "errors": errors}
