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

The ``ig_frozen_routing`` integral and ``routing_changes`` are in ``analysis.experiments.integrated_gradients``; layer
attribution (which kinds of layer carry the continuation) in ``analysis.experiments.layer_attribution``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from torch import nn

from analysis.experiments.attribution_inputs import AttributionError, check_ids
from analysis.experiments.integrated_gradients import integrated_gradients, routing_changes

METHODS = ("feature_ablation", "shapley", "integrated_gradients", "ig_frozen_routing")
IG_METHODS = ("integrated_gradients", "ig_frozen_routing")
#: |delta| above this share of |f(x) - f(baseline)| is reported as a failed integral (the result warns)
DELTA_WARN_SHARE = 0.05


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
    check_ids(input_ids, target_ids, model.config.vocab_size, baseline_token)
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
