"""LatentMoE (arXiv 2601.18089) as used by K3, and plain MoE when no latent width is set.

    s       = sigmoid(W_router x)                     fp32, on the full-width x
    chosen  = top_k(s + e_bias)                       e_bias steers selection only
    w       = s[chosen] / sum(s[chosen]) * routed_scaling_factor
    z       = W_down x                                D -> latent L (plain MoE: z = x)
    y       = sum_j w_j Expert_j(z)                   experts are gated FFNs L -> m -> L
    y       = W_up RMSNorm(y)                         after combining (LatentMoE only)
    out     = y + SharedExperts(x)                    full width, n_shared * m wide

Experts are stored stacked ([E, m, L] tensors); their state-dict keys are the published per-expert
``experts.E.w1/w2/w3.weight``. Dispatch (``StackedExperts.forward``) sorts the N*k (token, expert)
assignments by expert so that each expert's tokens are contiguous, then either

- ``"sorted_loop"``: one matmul chain per active expert (any device, any dtype), or
- ``"grouped_mm"``: three grouped matrix multiplies over all experts at once (``torch.nn.functional.
  grouped_mm`` / ``torch._grouped_mm``), used automatically for bf16 on CUDA GPUs of compute
  capability >= 8.0 once a one-off self-test (forward and backward against the loop) has passed;
  any failure falls back to the sorted loop.

``forward_masked_loop`` is the slow, obviously right reference (every expert, a boolean mask).
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ..config import K3Config
from ..hooks import HookPoint, active, point
from ..loading_state import ExpertWeightSource
from .ffn import GatedMLP, activation
from .norm import RMSNorm

DISPATCH_BACKENDS = ("auto", "sorted_loop", "grouped_mm")

_BTD = ("batch", "token", "hidden")

# The hook points of an MoE layer, in forward order (k3core.modeling.hooks; ``blocks.i.`` prefixed).
SCORES = HookPoint("moe.scores", ("batch", "token", "expert"), "sigmoid router scores")
SELECTION_BIAS = HookPoint("moe.selection_bias", ("expert",), "e_bias (steers selection only)")
SELECTION = HookPoint("moe.selection", ("batch", "token", "expert"), "scores + e_bias, ranked by top-k")
EXPERTS = HookPoint("moe.experts", ("batch", "token", "rank"), "chosen experts, by weight rank")
WEIGHTS = HookPoint("moe.weights", ("batch", "token", "rank"), "their routing weights")
LATENT = HookPoint("moe.latent", ("batch", "token", "latent"), "z = W_down x (plain MoE: x)")
ROUTED_OUT = HookPoint("moe.routed_out", _BTD, "routed experts' output (after W_up)")
SHARED_OUT = HookPoint("moe.shared_out", _BTD, "shared experts' output (when the layer has shared experts)")
POINTS = (SCORES, SELECTION_BIAS, SELECTION, EXPERTS, WEIGHTS, LATENT, ROUTED_OUT, SHARED_OUT)


def _grouped_mm_op():
    """torch's grouped GEMM (``F.grouped_mm``, or the older private ``torch._grouped_mm``), or None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _run_grouped_mm(z: torch.Tensor, offs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Rows of z grouped by expert (group e ends at offs[e]) times W_e^T: w [E, out, in] -> [rows, out]."""
    return _grouped_mm_op()(z, w.transpose(-2, -1), offs=offs)


@functools.cache
def _grouped_mm_works(device: str, dtype: torch.dtype) -> bool:
    """One-off self-test on (device, dtype): grouped GEMM forward and backward match per-expert matmuls.

    Includes an expert with no tokens. Any exception (unsupported GPU, dtype, layout) means False.
    """
    if _grouped_mm_op() is None:
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        counts = [5, 0, 11, 16]
        z = torch.randn(sum(counts), 32, generator=gen).to(device, dtype).requires_grad_()
        w = torch.randn(len(counts), 16, 32, generator=gen).to(device, dtype).requires_grad_()
        offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
        out = _run_grouped_mm(z, offs, w)
        out.float().square().sum().backward()
        gz, gw = z.grad.float(), w.grad.float()
        z.grad = w.grad = None
        ref = torch.cat([F.linear(part, w[e]) for e, part in enumerate(z.split(counts))])
        ref.float().square().sum().backward()
        tol = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
        return all(
            torch.allclose(a.float(), b.float(), rtol=tol, atol=tol * float(b.float().abs().max()))
            for a, b in ((out, ref), (gz, z.grad), (gw, w.grad))
        )
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return False


def grouped_mm_available(z: torch.Tensor) -> bool:
    """Whether ``dispatch="auto"`` uses grouped GEMM for z: bf16 on a CUDA GPU with capability >= 8.0
    whose self-test passed (see :func:`_grouped_mm_works`)."""
    if not z.is_cuda or z.dtype != torch.bfloat16 or _grouped_mm_op() is None:
        return False
    if torch.cuda.get_device_capability(z.device) < (8, 0):
        return False
    return _grouped_mm_works(str(z.device), z.dtype)


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert, ``[E]`` int64: ``bincount(experts, minlength=E)`` written as a scatter-add, whose
    output shape is E whatever the ids (bincount's is data dependent and breaks a torch.compile graph)."""
    return torch.zeros(num_experts, dtype=torch.int64, device=experts.device).scatter_add_(
        0, experts, torch.ones_like(experts, dtype=torch.int64)
    )


class Router(nn.Module):
    """Sigmoid router with a selection-only bias (keys ``gate.weight``, ``gate.e_score_correction_bias``)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x.float(), self.weight.float()))


class StackedExperts(nn.Module):
    """E gated FFNs, weights stacked: w1 (gate) [E, m, L], w3 (up) [E, m, L], w2 (down) [E, L, m]."""

    WEIGHTS = ("w1", "w2", "w3")
    # Optional source of expert weights: experts read on demand instead of the stacked parameters (which then stay
    # on the meta device); the model knows only its interface (k3core.modeling.loading_state.ExpertWeightSource)
    weight_source: ExpertWeightSource | None = None

    def __init__(self, config: K3Config, num_experts: int, width: int, intermediate: int):
        super().__init__()
        self.config = config
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate, width))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate, width))
        self.w2 = nn.Parameter(torch.empty(num_experts, width, intermediate))

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w2, w3) of expert e: from the weight source when there is one, else the stacked parameters."""
        if self.weight_source is not None:
            return self.weight_source.weights(e)
        return self.w1[e], self.w2[e], self.w3[e]

    def expert(self, e: int, z: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = self.expert_weights(e)
        return F.linear(activation(self.config, F.linear(z, w1), F.linear(z, w3)), w2)

    def forward(
        self, z: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, backend: str = "auto"
    ) -> torch.Tensor:
        """Grouped dispatch. z [N, L]; experts, weights [N, k]. Returns y = sum_j w_j Expert_j(z) [N, L].

        The N*k assignments are sorted by expert (stable, so within an expert tokens keep their order);
        each expert then runs once on its contiguous rows, the outputs are scaled by their routing
        weights and scattered back with index_add (summing a token's k contributions).
        ``backend``: "auto" (grouped GEMM where :func:`grouped_mm_available`, else the sorted loop),
        "sorted_loop", or "grouped_mm" (forced; on CPU torch supports its forward only).
        """
        if backend not in DISPATCH_BACKENDS:
            raise ValueError(f"backend must be one of {DISPATCH_BACKENDS}, got {backend!r}")
        if z.dim() != 2 or experts.shape != weights.shape or experts.shape[0] != z.shape[0]:
            raise ValueError(
                f"expected z [N, L], experts and weights [N, k]; got {tuple(z.shape)}, "
                f"{tuple(experts.shape)}, {tuple(weights.shape)}"
            )
        N, k = experts.shape
        if N == 0:
            return torch.zeros_like(z)
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)
        token_of = order // k
        counts = expert_counts(flat, self.num_experts)
        grouped = z.index_select(0, token_of)
        use_mm = self.weight_source is None and (
            backend == "grouped_mm" or (backend == "auto" and grouped_mm_available(z))
        )
        out = None
        if use_mm:
            try:
                out = self._experts_grouped_mm(grouped, counts)
            except Exception as exc:  # noqa: BLE001 - e.g. a layout this GPU's kernel rejects
                if backend == "grouped_mm":
                    raise
                warnings.warn(f"grouped_mm dispatch failed ({exc}); using the sorted loop", stacklevel=2)
        if out is None:
            out = self._experts_sorted_loop(grouped, counts.tolist())
        out = out * weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        return torch.zeros_like(z).index_add_(0, token_of, out.to(z.dtype))

    # Eager under torch.compile: its shapes are the routing's counts, so a compiled loop would recompile on every
    # new count (and hit the recompile limit within a few steps of training).
    @torch.compiler.disable
    def _experts_sorted_loop(self, grouped: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows sorted by expert, counts[e] rows for expert e: one matmul chain per active expert."""
        outputs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                outputs.append(self.expert(e, grouped[start : start + n]))
                start += n
        return torch.cat(outputs)

    def _experts_grouped_mm(self, grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The same with three grouped GEMMs (gate, up, down) over all experts; no host sync."""
        offs = counts.cumsum(0).to(torch.int32)
        gate = _run_grouped_mm(grouped, offs, self.w1)
        up = _run_grouped_mm(grouped, offs, self.w3)
        return _run_grouped_mm(activation(self.config, gate, up), offs, self.w2)

    def forward_masked_loop(self, z: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Reference dispatch: every expert, a boolean mask over tokens (slow, obviously right)."""
        y = torch.zeros_like(z)
        for e in range(self.num_experts):
            hit = experts == e  # [N, k]
            rows = hit.any(-1)
            if rows.any():
                w = (weights * hit).sum(-1, keepdim=True)[rows].to(z.dtype)
                y[rows] += w * self.expert(e, z[rows])
        return y

    # Published checkpoints list each expert separately: experts.E.{w1,w2,w3}.weight
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name in self.WEIGHTS:
            param = getattr(self, name)
            param = param if keep_vars else param.detach()
            for e in range(self.num_experts):
                destination[f"{prefix}{e}.{name}.weight"] = param[e]

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        expected = set()
        for name in self.WEIGHTS:
            param = getattr(self, name)
            for e in range(self.num_experts):
                key = f"{prefix}{e}.{name}.weight"
                expected.add(key)
                if key not in state_dict:
                    missing_keys.append(key)
                    continue
                value = state_dict[key]
                if tuple(value.shape) != tuple(param.shape[1:]):
                    error_msgs.append(
                        f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, "
                        f"the shape in current model is {tuple(param.shape[1:])}."
                    )
                    continue
                with torch.no_grad():
                    param[e].copy_(value)
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in expected)


class LatentMoE(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        D, E = config.hidden_size, config.num_experts
        m = config.scaled_width(config.moe_intermediate_size, layer_idx)
        self.latent = config.routed_expert_hidden_size
        width = self.latent or D
        self.gate = Router(D, E)
        if self.latent:
            self.routed_expert_down_proj = nn.Linear(D, self.latent, bias=False)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(self.latent, config.rms_norm_eps)
            self.routed_expert_up_proj = nn.Linear(self.latent, D, bias=False)
        self.experts = StackedExperts(config, E, width, m)
        if config.num_shared_experts:
            self.shared_experts = GatedMLP(config, D, config.num_shared_experts * m)
        # Balancing statistics of the last training forward (read by k3core.training.balancing).
        self.last_load: torch.Tensor | None = None
        self.last_scores: torch.Tensor | None = None
        self.aux_loss: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., D] -> (scores [..., E], experts [..., k], weights [..., k]); experts sorted by weight."""
        ctx, i = active(), self.layer_idx
        scores = point(ctx, SCORES.at(i), self.gate(x))
        bias = point(ctx, SELECTION_BIAS.at(i), self.gate.e_score_correction_bias)
        selection = point(ctx, SELECTION.at(i), scores + bias)
        k = self.config.num_experts_per_token
        chosen = selection.topk(k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20) * self.config.routed_scaling_factor
        weights, order = weights.sort(dim=-1, descending=True)
        experts = point(ctx, EXPERTS.at(i), chosen.gather(-1, order))
        return scores, experts, point(ctx, WEIGHTS.at(i), weights)

    def routed_experts(
        self, z: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, dispatch: str
    ) -> torch.Tensor:
        """y = sum_j w_j Expert_j(z) for z [N, L]: the one place expert weights are used (swap the source here)."""
        if dispatch == "masked":
            return self.experts.forward_masked_loop(z, experts, weights)
        return self.experts(z, experts, weights, backend="auto" if dispatch == "grouped" else dispatch)

    def forward(self, x: torch.Tensor, dispatch: str = "grouped") -> torch.Tensor:
        """x [B, T, D]. ``dispatch``: "grouped" (auto backend), "sorted_loop", "grouped_mm" or "masked"."""
        if dispatch not in ("grouped", "sorted_loop", "grouped_mm", "masked"):
            raise ValueError(f"dispatch must be 'grouped', 'sorted_loop', 'grouped_mm' or 'masked', got {dispatch!r}")
        ctx, i = active(), self.layer_idx
        B, T, D = x.shape
        scores, experts, weights = (t.flatten(0, 1) for t in self.route(x))
        if self.experts.weight_source is not None:
            self.experts.weight_source.request(experts)  # reads start now, while the latent projection runs
        z = self.routed_expert_down_proj(x) if self.latent else x
        z = point(ctx, LATENT.at(i), z).reshape(-1, z.shape[-1])
        y = self.routed_experts(z, experts, weights, dispatch)
        if self.latent:
            if self.config.latent_moe_use_norm:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        y = point(ctx, ROUTED_OUT.at(i), y.view(B, T, D))
        if self.config.num_shared_experts:
            y = y + point(ctx, SHARED_OUT.at(i), self.shared_experts(x))
        if self.training:
            self._balance_stats(scores, experts)
        return y

    def _balance_stats(self, scores: torch.Tensor, experts: torch.Tensor) -> None:
        E = self.config.num_experts
        load = expert_counts(experts.reshape(-1), E)
        self.last_load = load.detach()
        if self.config.balancing == "quantile":
            self.last_scores = scores.detach()
        if self.config.balancing == "aux_loss":
            # Switch Transformer: E * sum_i f_i P_i, f = share of assignments, P = mean routing probability.
            f = load.float() / experts.numel()
            P = (scores / scores.sum(-1, keepdim=True)).mean(0)
            self.aux_loss = E * (f * P).sum()
