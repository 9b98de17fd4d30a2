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

Baseline: every input token replaced by ``baseline_token`` (default 0), stated in the result.

Layer attribution (``layer_attribution``): Captum ``IntegratedGradients`` on one multiplier per element of
every sub-layer output (the KDA / MLA mixer outputs, dense FFN outputs, routed-expert and shared-expert
outputs, hook points of ``k3core.hooks``), from all multipliers 0 (every sub-layer output removed) to 1
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

from k3core.hooks import HookNames, hooks

METHODS = ("feature_ablation", "shapley", "integrated_gradients")


class AttributionError(ValueError):
    """Inputs or options attribution cannot use."""


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
        if method == "integrated_gradients":
            lig = LayerIntegratedGradients(wrapped, model.model.embed_tokens)
            result = LLMGradientAttribution(lig, tok).attribute(inp, target=target_ids, n_steps=n_steps)
            matrix = result.token_attr.detach().float().cpu()
            base = torch.full_like(input_ids, baseline_token)
            difference = (
                target_log_probs(model, input_ids, target_ids) - target_log_probs(model, base, target_ids)
            ).tolist()
            delta = [float(matrix[j].sum()) - difference[j] for j in range(len(difference))]
        else:
            algo = FeatureAblation(wrapped) if method == "feature_ablation" else ShapleyValueSampling(wrapped)
            llm = LLMAttribution(algo, tok, attr_target="log_prob")
            kwargs = {"n_samples": n_samples} if method == "shapley" else {}
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
        extra={"n_steps": n_steps} if method == "integrated_gradients" else {"n_samples": n_samples},
    )


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
