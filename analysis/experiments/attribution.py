"""Attribution with Captum: which input tokens, and which kinds of layer, carry a continuation.

Token attribution, per output token x input token, for a target continuation y_1..y_m of a prompt x:

- ``feature_ablation`` (Captum ``LLMAttribution`` + ``FeatureAblation``): attr[j, i] = log p(y_j | x, y_<j)
  - the same with input token i replaced by the baseline token;
- ``shapley`` (``LLMAttribution`` + ``ShapleyValueSampling``): Shapley values of the input tokens
  (present / replaced by the baseline token) for log p(y_j | ...), sampled;
- ``integrated_gradients`` (``LLMGradientAttribution`` + ``LayerIntegratedGradients`` on the embedding):
  attr[j, i] = sum_d (e_i - e'_i)_d * integral_0^1 d log p(y_j) / d e_i(alpha) dalpha along the straight
  path from the baseline token's embedding e' to the input's e. Completeness: sum_i attr[j, i] =
  f_j(x) - f_j(baseline) + delta_j; ``delta`` (the convergence delta) is reported per output token.

- ``ig_frozen_routing`` (our own integral, checked against Captum on dense models): the same integral with every
  MoE layer's top-k expert set held at the one the input x chose (the gate weights of that set still vary along
  the path). Plain IG on an MoE model integrates a discontinuous function: each time a token's top-k set changes
  along the path its output jumps, the gradient never sees the jump and completeness fails at any number of steps.
  With the routing frozen the function is smooth, so sum_i attr[j, i] = g_j(x) - g_j(baseline) (g: the frozen-routing
  model; g(x) = f(x)) up to the quadrature error, which falls fast with ``n_steps`` (Gauss-Legendre nodes).
  Plain IG's result carries ``routing_changes``: how many (MoE layer, position) top-k sets change between neighbouring
  points of an evenly spaced path of ``n_steps`` + 1 points (0 on a dense model).

Baseline: every input token replaced by ``baseline_token`` (default 0), stated in the result. Shapley sampling
draws its permutations from a generator seeded with ``seed``: the same call gives the same values.

Layer attribution (``layer_attribution``): Captum ``IntegratedGradients`` on one multiplier per element of
every sub-layer output (the KDA / MLA mixer outputs, dense FFN outputs, routed-expert and shared-expert
outputs, hook points of ``k3core.interp.hooks``), from all multipliers 0 (every sub-layer output removed) to 1
(the model as it is), for f = sum_j log p(y_j | x, y_<j). Each output's attribution, summed over its
elements, says how much of f flows through it; grouped by mixer type (KDA vs MLA) and FFN kind (dense,
routed, shared). Completeness again: the sum over everything = f(model) - f(no sub-layers) + delta.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from torch import nn

from k3core.interp.hooks import HookNames, hooks
from k3core.model import EMBED

METHODS = ("feature_ablation", "shapley", "integrated_gradients", "ig_frozen_routing")
IG_METHODS = ("integrated_gradients", "ig_frozen_routing")
#: |delta| above this share of |f(x) - f(baseline)| is reported as a failed integral (the result warns)
DELTA_WARN_SHARE = 0.05


class AttributionError(ValueError):
    """Inputs or options attribution cannot use."""


def attribution_forwards(
    method: str, prompt_tokens: int, targets: int, steps: int = 64, samples: int = 8, moe: bool = False
) -> tuple[int, int]:
    """(fewest, most) sequences one attribution runs through the model, a backward counted as two forwards (a batch
    of k rows counts k), for n prompt and m target tokens:

    - feature_ablation: n + 1 (each prompt token replaced, and the input; every target read from one forward);
    - shapley: samples * n + 1;
    - integrated_gradients: m (3 steps + 2) + 2, plus steps + 1 on an MoE model (its routing changes on the path);
    - ig_frozen_routing: 3 steps + m + 2, up to 16 times that (the worst panels halved until the integral
      converges, at most 16 steps points);
    - "layers" (layer attribution): 3 steps + 5.

    tests/analysis/experiments/test_attribution_cost.py counts them on a real model."""
    n, m = int(prompt_tokens), int(targets)
    if method == "feature_ablation":
        cost = n + 1
    elif method == "shapley":
        cost = samples * n + 1
    elif method == "integrated_gradients":
        cost = m * (3 * steps + 2) + 2 + (steps + 1 if moe else 0)
    elif method == "ig_frozen_routing":
        low = 3 * steps + m + 2
        return low, 16 * low
    elif method == "layers":
        cost = 3 * steps + 5
    else:
        raise AttributionError(f"unknown method {method!r}; methods: {', '.join((*METHODS, 'layers'))}")
    return cost, cost


@dataclass
class TokenAttribution:
    method: str
    matrix: torch.Tensor  # [output token, input token]
    input_ids: list[int]
    target_ids: list[int]
    input_labels: list[str]
    output_labels: list[str]
    baseline: str
    delta: list[float] | None = None  # IG convergence delta per output token
    difference: list[float] | None = None  # f_j(x) - f_j(baseline) per output token
    extra: dict[str, Any] = field(default_factory=dict)

    def delta_share(self) -> list[float] | None:
        """|delta_j| / |f_j(x) - f_j(baseline)| per output token (inf where the difference is 0); None without IG."""
        if self.delta is None or self.difference is None:
            return None
        return [abs(d) / abs(f) if f else float("inf") for d, f in zip(self.delta, self.difference)]

    def warning(self) -> str | None:
        """A sentence when the integral did not converge (|delta| over DELTA_WARN_SHARE of the difference), else None:
        the attributions then do not add up to the change they claim to split."""
        shares = self.delta_share()
        if not shares or max(shares) <= DELTA_WARN_SHARE:
            return None
        worst = max(shares)
        text = (
            f"the attributions miss f(x) - f(baseline) by up to {worst:.0%} (|delta|) of it: they do not add up "
            f"to the change they split"
        )
        changes = self.extra.get("routing_changes")
        if changes:
            text += (
                f". The top-k expert set changed {changes:,} times along the path: the function jumps there, so "
                f"more steps do not help; use ig_frozen_routing (routing held at the input's)"
            )
        elif self.method == "integrated_gradients":
            text += "; more steps may help"
        elif self.method == "ig_frozen_routing":
            # the routing is frozen, so the path is smooth: the adaptive panels ran out of points on a steep stretch
            text += (
                f". The path has a steep stretch its {self.extra.get('path_points', '?')} points did not resolve "
                f"(the panels stop at 16x the steps): raise the steps"
            )
        return text

    def table(self) -> pd.DataFrame:
        """Tidy: output, output_token, input, input_token, attribution."""
        rows = [
            dict(output=j, output_token=self.output_labels[j], input=i, input_token=self.input_labels[i], attribution=v)
            for j, row in enumerate(self.matrix.tolist())
            for i, v in enumerate(row)
        ]
        return pd.DataFrame(rows)


class _CaptumModel(nn.Module):
    """The forward Captum's LLM wrappers call (Hugging Face keywords accepted and ignored)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def forward(self, input_ids: torch.Tensor, **ignored: Any) -> Any:
        return self.model(input_ids)


class _KnownIdsTokenizer:
    """What Captum asks of a tokenizer, over token ids we already have (nothing is re-tokenised): the
    "text" of an id list is its labels joined, remembered so encoding it gives the ids back."""

    def __init__(self, label: Any):
        self.label = label
        self._known: dict[str, tuple[list[int], list[tuple[int, int]]]] = {}

    def text_of(self, ids: list[int]) -> str:
        labels = self.label(ids)
        offsets, pos = [], 0
        for s in labels:
            offsets.append((pos, pos + len(s)))
            pos += len(s)
        text = "".join(labels)
        self._known[text] = (list(ids), offsets)
        return text

    def encode(self, text: str, return_tensors: str | None = None, add_special_tokens: bool = True) -> Any:
        ids = self._known[text][0]
        return torch.tensor([ids]) if return_tensors == "pt" else list(ids)

    def decode(self, ids: Any) -> str:
        return self.text_of([int(i) for i in torch.as_tensor(ids).reshape(-1)])

    def __call__(self, text: str, return_offsets_mapping: bool = False, add_special_tokens: bool = True) -> dict:
        ids, offsets = self._known[text]
        return {"input_ids": ids, "offset_mapping": offsets}

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return self.label([int(i) for i in ids])


def _labels(tokenizer: Any) -> Any:
    if tokenizer is not None and hasattr(tokenizer, "token_strings"):
        return lambda ids: [repr(s)[1:-1] or "∅" for s in tokenizer.token_strings(ids)]
    return lambda ids: [str(i) for i in ids]


def _check(input_ids: torch.Tensor, target_ids: torch.Tensor, vocab: int, baseline_token: int) -> None:
    for name, ids in (("input", input_ids), ("target", target_ids)):
        if ids.dim() != 1 or ids.numel() == 0:
            raise AttributionError(f"{name} ids must be a non-empty 1-d tensor, got shape {tuple(ids.shape)}")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise AttributionError(f"{name} ids must lie in 0..{vocab - 1}")
    if not 0 <= baseline_token < vocab:
        raise AttributionError(f"baseline token must lie in 0..{vocab - 1}, got {baseline_token}")


@torch.no_grad()
def target_log_probs(model: nn.Module, input_ids: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """log p(y_j | x, y_<j) for every target token, [m] (one forward of x + y)."""
    ids = torch.cat([input_ids, target_ids]).unsqueeze(0)
    logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    n = input_ids.numel()
    return logp[n - 1 : n - 1 + target_ids.numel()].gather(1, target_ids.unsqueeze(1))[:, 0]


def token_attribution(
    model: nn.Module,
    input_ids: torch.Tensor,
    target_ids: torch.Tensor,
    method: str = "feature_ablation",
    baseline_token: int = 0,
    tokenizer: Any = None,
    n_steps: int = 64,
    n_samples: int = 8,
    seed: int = 0,
) -> TokenAttribution:
    """Attribution of each target token's log-probability to each input token (see the module docstring)."""
    from captum.attr import (
        FeatureAblation,
        LayerIntegratedGradients,
        LLMAttribution,
        LLMGradientAttribution,
        ShapleyValueSampling,
        TextTokenInput,
    )

    if method not in METHODS:
        raise AttributionError(f"unknown method {method!r}; methods: {', '.join(METHODS)}")
    input_ids, target_ids = input_ids.reshape(-1).cpu(), target_ids.reshape(-1).cpu()
    _check(input_ids, target_ids, model.config.vocab_size, baseline_token)
    label = _labels(tokenizer)
    tok = _KnownIdsTokenizer(label)
    wrapped = _CaptumModel(model)
    was_training = model.training
    model.eval()
    try:
        text = tok.text_of(input_ids.tolist())
        tok.text_of(target_ids.tolist())
        inp = TextTokenInput(text, tok, baselines=baseline_token)
        delta = difference = None
        extra: dict[str, Any] = {"n_samples": n_samples, "seed": seed} if method == "shapley" else {}
        if method == "ig_frozen_routing":
            matrix, difference, used = integrated_gradients(model, input_ids, target_ids, baseline_token, n_steps)
            delta = [float(matrix[j].sum()) - difference[j] for j in range(len(difference))]
            extra = {"n_steps": n_steps, "path_points": used, "routing": "frozen at the input's top-k expert sets"}
        elif method == "integrated_gradients":
            lig = LayerIntegratedGradients(wrapped, model.model.embed_tokens)
            result = LLMGradientAttribution(lig, tok).attribute(inp, target=target_ids, n_steps=n_steps)
            matrix = result.token_attr.detach().float().cpu()
            base = torch.full_like(input_ids, baseline_token)
            difference = (
                target_log_probs(model, input_ids, target_ids) - target_log_probs(model, base, target_ids)
            ).tolist()
            delta = [float(matrix[j].sum()) - difference[j] for j in range(len(difference))]
            changes = routing_changes(model, input_ids, target_ids, baseline_token, n_steps)
            extra = {"n_steps": n_steps, "routing_changes": changes}
        else:
            algo = FeatureAblation(wrapped) if method == "feature_ablation" else ShapleyValueSampling(wrapped)
            llm = LLMAttribution(algo, tok, attr_target="log_prob")
            kwargs = {"n_samples": n_samples} if method == "shapley" else {}
            # Captum draws Shapley permutations from torch's global generator: seeded here, the caller's left alone
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                result = llm.attribute(inp, target=target_ids, forward_in_tokens=False, **kwargs)
            matrix = result.token_attr.detach().float().cpu()
    finally:
        model.train(was_training)
    return TokenAttribution(
        method=method,
        matrix=matrix,
        input_ids=input_ids.tolist(),
        target_ids=target_ids.tolist(),
        input_labels=label(input_ids.tolist()),
        output_labels=label(target_ids.tolist()),
        baseline=f"every input token replaced by token {baseline_token} ({label([baseline_token])[0]!r})",
        delta=delta,
        difference=difference,
        extra=extra,
    )


def _moe_points(config: Any, name: str) -> list[str]:
    return [HookNames.block(i, f"moe.{name}") for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]


def _embedded_path(
    model: nn.Module, ids: torch.Tensor, n: int, baseline_token: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e, e'): the embedding of x + y [L, D], and of the baseline (input positions 0..n-1 replaced by the baseline
    token; the target tokens keep theirs, so they get no attribution)."""
    base_ids = ids.clone()
    base_ids[:n] = baseline_token
    with torch.no_grad():
        embed = model.model.embed_tokens
        return embed(ids.unsqueeze(0))[0].float(), embed(base_ids.unsqueeze(0))[0].float()


def _input_routing(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every MoE layer's chosen experts [1, L, k] on the input (a causal model: a prefix routes as the whole)."""
    chosen: dict[str, torch.Tensor] = {}
    names = _moe_points(model.config, "experts")
    with torch.no_grad(), hooks(read={p: (lambda v, name, info: chosen.__setitem__(name, v.clone())) for p in names}):
        model(ids.unsqueeze(0))
    return chosen


def _frozen_selection(chosen: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Write hooks on moe.selection that make top-k pick the recorded experts at every position, batch expanded
    (1 on the recorded set, 0 elsewhere: the gate weights are still read from the scores of that set)."""

    def hook_for(experts: torch.Tensor) -> Any:
        def hook(value: torch.Tensor, name: str, info: dict) -> torch.Tensor:
            picks = experts.to(value.device).expand(value.shape[0], -1, -1)
            return torch.zeros_like(value).scatter(-1, picks, 1.0)

        return hook

    return {name.replace("moe.experts", "moe.selection"): hook_for(e) for name, e in chosen.items()}


#: Gauss-Legendre nodes per panel of the adaptive IG path
PANEL_NODES = 4


def integrated_gradients(
    model: nn.Module,
    input_ids: torch.Tensor,
    target_ids: torch.Tensor,
    baseline_token: int = 0,
    n_steps: int = 64,
    freeze_routing: bool = True,
    max_steps: int | None = None,
    rtol: float = 1e-4,
) -> tuple[torch.Tensor, list[float], int]:
    """(attr [m, n], g(x) - g(baseline) per target, path points used) of IG on the embeddings of the input tokens:

        attr[j, i] = sum_d (e_i - e'_i)_d * sum_k w_k d g_j / d e_i (e' + a_k (e - e'))

    for g_j = log p(y_j | x, y_<j) of one forward over x + y, with every MoE layer's top-k experts held at the ones x
    chose when ``freeze_routing`` (then g is smooth). The nodes (a_k, w_k): Gauss-Legendre, PANEL_NODES per panel of
    [0, 1], starting from n_steps / PANEL_NODES equal panels. Each panel [a, b] checks itself (its attributions must
    sum to g(b) - g(a): the path of a trained model has narrow steep stretches, where an embedding passes near the
    origin of an RMSNorm); the worst panels are halved until sum_panels |that miss| <= rtol |g(x) - g(baseline)|
    or ``max_steps`` points (default 16 n_steps) are spent. The reported delta then says what is left."""
    import numpy as np

    if n_steps < 1:
        raise AttributionError(f"n_steps must be at least 1, got {n_steps}")
    max_steps = 16 * n_steps if max_steps is None else max_steps
    device = next(model.parameters()).device
    ids = torch.cat([input_ids, target_ids]).to(device)
    n, m = input_ids.numel(), target_ids.numel()
    e, e_base = _embedded_path(model, ids, n, baseline_token)
    nodes, weights = np.polynomial.legendre.leggauss(PANEL_NODES)
    write = _frozen_selection(_input_routing(model, ids)) if freeze_routing else {}
    targets = target_ids.to(device)
    dtype = model.model.embed_tokens.weight.dtype

    def g(alphas: list[float], grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(points [S, L, D], target log-probabilities [S, m]) at path points e' + a (e - e')."""
        a = torch.tensor(alphas, dtype=torch.float32, device=device).view(-1, 1, 1)
        point = (e_base + a * (e - e_base)).requires_grad_(grad)
        with hooks(write={**write, EMBED.at(): lambda v, name, info: point.to(dtype)}):
            logits = model(ids.unsqueeze(0).expand(point.shape[0], -1)).logits.float()
        logp = torch.log_softmax(logits[:, n - 1 : n - 1 + m], -1)
        return point, logp.gather(2, targets.expand(point.shape[0], -1).unsqueeze(-1))[..., 0]

    ends: dict[float, torch.Tensor] = {}

    def value_at(alphas: list[float]) -> None:
        todo = sorted({a for a in alphas if a not in ends})
        with torch.no_grad():
            for start in range(0, len(todo), 16):
                _, out = g(todo[start : start + 16])
                ends.update(zip(todo[start : start + 16], out))

    def panel_attributions(panels: list[tuple[float, float]]) -> list[torch.Tensor]:
        """Each panel's attributions [m, L] (16 points per forward: bounded memory)."""
        out = []
        for start in range(0, len(panels), 16 // PANEL_NODES):
            group = panels[start : start + 16 // PANEL_NODES]
            alphas = [lo + (hi - lo) * (x + 1) / 2 for lo, hi in group for x in nodes]
            w = torch.tensor([(hi - lo) * wk / 2 for lo, hi in group for wk in weights], device=device)
            point, logp = g(alphas, grad=True)
            grads = torch.stack(
                [torch.autograd.grad((logp[:, j] * w).sum(), point, retain_graph=j + 1 < m)[0] for j in range(m)]
            )  # [m, S, L, D]: the weighted gradient at each node
            per_node = (grads * (e - e_base)).sum(-1).detach()  # [m, S, L]
            out += list(per_node.view(m, len(group), PANEL_NODES, -1).sum(2).unbind(1))
        return out

    count = max(1, round(n_steps / PANEL_NODES))
    panels = [(k / count, (k + 1) / count) for k in range(count)]
    attrs = dict(zip(panels, panel_attributions(panels)))
    used = PANEL_NODES * count
    value_at([0.0, 1.0] + [a for p in panels for a in p])
    difference = (ends[1.0] - ends[0.0]).abs().clamp_min(1e-12)
    while True:
        miss = {p: (attrs[p].sum(-1) - (ends[p[1]] - ends[p[0]])).abs() / difference for p in attrs}
        if float(sum(miss.values()).max()) <= rtol or used + 2 * PANEL_NODES > max_steps:
            break
        worst = sorted(miss, key=lambda p: float(miss[p].max()), reverse=True)
        worst = worst[: max(1, min(8 // PANEL_NODES, (max_steps - used) // (2 * PANEL_NODES)))]  # 16 new points
        halves = [h for lo, hi in worst for h in ((lo, (lo + hi) / 2), ((lo + hi) / 2, hi))]
        for p in worst:
            del attrs[p]
        attrs.update(zip(halves, panel_attributions(halves)))
        used += PANEL_NODES * len(halves)
        value_at([a for p in halves for a in p])
    matrix = torch.stack(list(attrs.values())).sum(0)[:, :n].cpu()
    return matrix, (ends[1.0] - ends[0.0]).tolist(), used


@torch.no_grad()
def routing_changes(
    model: nn.Module, input_ids: torch.Tensor, target_ids: torch.Tensor, baseline_token: int = 0, n_steps: int = 64
) -> int:
    """How many (MoE layer, position) top-k expert sets differ between neighbouring points of the straight path
    e' + a (e - e'), a = 0, 1/n_steps, ..., 1 (each is a jump plain IG cannot integrate); 0 on a dense model."""
    names = _moe_points(model.config, "experts")
    if not names:
        return 0
    device = next(model.parameters()).device
    ids = torch.cat([input_ids, target_ids]).to(device)
    e, e_base = _embedded_path(model, ids, input_ids.numel(), baseline_token)
    dtype = model.model.embed_tokens.weight.dtype
    previous: dict[str, torch.Tensor] = {}
    changes = 0
    alphas = torch.linspace(0, 1, n_steps + 1, device=device)
    for start in range(0, n_steps + 1, 16):
        a = alphas[start : start + 16].view(-1, 1, 1)
        point = e_base + a * (e - e_base)
        chosen: dict[str, torch.Tensor] = {}
        read = {p: (lambda v, name, info, into=chosen: into.__setitem__(name, v.sort(-1).values)) for p in names}
        with hooks(read=read, write={EMBED.at(): lambda v, name, info, at=point: at.to(dtype)}):
            model(ids.unsqueeze(0).expand(point.shape[0], -1))
        for name, sets in chosen.items():
            if name in previous:
                sets = torch.cat([previous[name], sets])
            changes += int((sets[1:] != sets[:-1]).any(-1).sum())
            previous[name] = sets[-1:]
    return changes


def layer_points(config: Any) -> list[tuple[int, str, str, str]]:
    """(layer, group, kind, hook point) of every sub-layer output: group "mixer" (kind KDA / MLA) or
    "ffn" (kind dense / routed / shared)."""
    out = []
    for i in range(config.num_hidden_layers):
        mixer = "MLA" if config.is_mla_layer(i) else "KDA"
        out.append((i, "mixer", mixer, HookNames.block(i, "mixer_out")))
        if config.is_moe_layer(i):
            out.append((i, "ffn", "routed", HookNames.block(i, "moe.routed_out")))
            if config.num_shared_experts:
                out.append((i, "ffn", "shared", HookNames.block(i, "moe.shared_out")))
        else:
            out.append((i, "ffn", "dense", HookNames.block(i, "ffn_out")))
    return out


@dataclass
class LayerAttribution:
    table: pd.DataFrame  # layer, group, kind, point, attribution
    by_kind: pd.DataFrame  # group, kind, attribution
    f_model: float  # f with every output as it is
    f_baseline: float  # f with every sub-layer output removed
    delta: float  # Captum's convergence delta
    baseline: str = "every sub-layer output multiplied by 0 (the multipliers' baseline)"


def layer_attribution(
    model: nn.Module, input_ids: torch.Tensor, target_ids: torch.Tensor, n_steps: int = 64
) -> LayerAttribution:
    """Integrated gradients over multipliers of every sub-layer output (see the module docstring)."""
    from captum.attr import IntegratedGradients

    input_ids, target_ids = input_ids.reshape(-1).cpu(), target_ids.reshape(-1).cpu()
    _check(input_ids, target_ids, model.config.vocab_size, 0)
    config = model.config
    entries = layer_points(config)
    ids = torch.cat([input_ids, target_ids]).unsqueeze(0)
    n, m = input_ids.numel(), target_ids.numel()
    shapes: dict[str, tuple[int, ...]] = {}
    with (
        torch.no_grad(),
        hooks(read={p: (lambda v, name, info: shapes.__setitem__(name, v.shape)) for *_, p in entries}),
    ):
        model(ids)

    def f(*multipliers: torch.Tensor) -> torch.Tensor:
        batch = multipliers[0].shape[0]
        write = {
            point: (lambda v, name, info, k=k: v * multipliers[k].to(v.dtype)) for k, (*_, point) in enumerate(entries)
        }
        with hooks(write=write):
            logits = model(ids.expand(batch, -1)).logits.float()
        logp = torch.log_softmax(logits[:, n - 1 : n - 1 + m], -1)
        return logp.gather(2, target_ids.to(logp.device).expand(batch, -1).unsqueeze(-1))[..., 0].sum(-1)

    device = next(model.parameters()).device
    ones = tuple(torch.ones(shapes[p][1:], device=device).unsqueeze(0) for *_, p in entries)
    zeros = tuple(torch.zeros_like(t) for t in ones)
    was_training = model.training
    model.eval()
    try:
        ig = IntegratedGradients(f)
        attrs, delta = ig.attribute(ones, baselines=zeros, n_steps=n_steps, return_convergence_delta=True)
        with torch.no_grad():
            f_model, f_base = float(f(*ones)), float(f(*zeros))
    finally:
        model.train(was_training)
    rows = [
        dict(layer=i, group=group, kind=kind, point=point, attribution=float(a.sum()))
        for (i, group, kind, point), a in zip(entries, attrs)
    ]
    table = pd.DataFrame(rows)
    by_kind = table.groupby(["group", "kind"], as_index=False)["attribution"].sum()
    return LayerAttribution(table, by_kind, f_model, f_base, float(delta.reshape(-1)[0]))
