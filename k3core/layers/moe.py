"""LatentMoE (arXiv 2601.18089) as used by K3, and plain MoE when no latent width is set.

    s       = sigmoid(W_router x)                     fp32, on the full-width x
    chosen  = top_k(s + e_bias)                       e_bias steers selection only
    w       = s[chosen] / sum(s[chosen]) * routed_scaling_factor
    z       = W_down x                                D -> latent L (plain MoE: z = x)
    y       = sum_j w_j Expert_j(z)                   experts are gated FFNs L -> m -> L
    y       = W_up RMSNorm(y)                         after combining (LatentMoE only)
    out     = y + SharedExperts(x)                    full width, n_shared * m wide

Experts are stored stacked ([E, m, L] tensors) so dispatch is a sort plus one matmul chain per
active expert; their state-dict keys are the published per-expert ``experts.E.w1/w2/w3.weight``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import trace as _trace
from ..config import K3Config
from .ffn import GatedMLP, activation
from .norm import RMSNorm


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

    def __init__(self, config: K3Config, num_experts: int, width: int, intermediate: int):
        super().__init__()
        self.config = config
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate, width))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate, width))
        self.w2 = nn.Parameter(torch.empty(num_experts, width, intermediate))

    def expert(self, e: int, z: torch.Tensor) -> torch.Tensor:
        return F.linear(activation(self.config, F.linear(z, self.w1[e]), F.linear(z, self.w3[e])), self.w2[e])

    def forward(self, z: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Grouped dispatch. z [N, L]; experts, weights [N, k]. Returns sum_j w_j Expert_j(z) [N, L].

        Assignments are sorted by expert so each active expert runs once on a contiguous batch.
        """
        N, k = experts.shape
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)
        token_of = order // k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        grouped = z.index_select(0, token_of)
        outputs = []
        start = 0
        for e, n in enumerate(counts):
            if n:
                outputs.append(self.expert(e, grouped[start:start + n]))
                start += n
        if not outputs:
            return torch.zeros_like(z)
        out = torch.cat(outputs) * weights.reshape(-1)[order].unsqueeze(-1).to(z.dtype)
        return torch.zeros_like(z).index_add_(0, token_of, out)

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

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
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
                    error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, "
                                      f"the shape in current model is {tuple(param.shape[1:])}.")
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
        # Balancing statistics of the last training forward (read by update_bias / the trainer).
        self.last_load: torch.Tensor | None = None
        self.aux_loss: torch.Tensor | None = None
        self._last_scores: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D] -> (scores [N, E], experts [N, k], weights [N, k]); experts sorted by weight."""
        scores = self.gate(x)
        k = self.config.num_experts_per_token
        chosen = (scores + self.gate.e_score_correction_bias).topk(k, dim=-1).indices
        weights = scores.gather(1, chosen)
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20) * self.config.routed_scaling_factor
        weights, order = weights.sort(dim=-1, descending=True)
        return scores, chosen.gather(1, order), weights

    def forward(self, x: torch.Tensor, dispatch: str = "grouped") -> torch.Tensor:
        B, T, D = x.shape
        flat = x.reshape(-1, D)
        scores, experts, weights = self.route(flat)
        z = self.routed_expert_down_proj(flat) if self.latent else flat
        run = self.experts if dispatch == "grouped" else self.experts.forward_masked_loop
        y = run(z, experts, weights)
        if self.latent:
            if self.config.latent_moe_use_norm:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if self.config.num_shared_experts:
            y = y + self.shared_experts(flat)

        if self.training:
            self._balance_stats(scores, experts)
        rec = _trace.current()
        if rec is not None and rec.wants("moe"):
            self._record(rec, B, T, scores, experts, weights, z)
        return y.view(B, T, D)

    def _balance_stats(self, scores: torch.Tensor, experts: torch.Tensor) -> None:
        E = self.config.num_experts
        load = torch.bincount(experts.reshape(-1), minlength=E)
        self.last_load = load.detach()
        if self.config.balancing == "quantile":
            self._last_scores = scores.detach()
        if self.config.balancing == "aux_loss":
            # Switch Transformer: E * sum_i f_i P_i, f = share of assignments, P = mean routing probability.
            f = load.float() / experts.numel()
            P = (scores / scores.sum(-1, keepdim=True)).mean(0)
            self.aux_loss = E * (f * P).sum()

    @torch.no_grad()
    def update_bias(self) -> None:
        """Selection-bias update after an optimiser step (auxiliary-loss-free balancing)."""
        rule = self.config.balancing
        bias = self.gate.e_score_correction_bias
        if rule == "sign" and self.last_load is not None:
            load = self.last_load.float()
            bias += self.config.bias_update_rate * torch.sign(load.mean() - load)
        elif rule == "quantile" and self._last_scores is not None:
            # K3's rule: alpha_t = (k+1)-th largest s+b per token; b_j = quantile_t(alpha_t - s_tj, k/E).
            s = self._last_scores
            k, E = self.config.num_experts_per_token, self.config.num_experts
            if k < E:
                alpha = (s + bias).topk(k + 1, dim=-1).values[:, -1:]
                target = torch.quantile(alpha - s, k / E, dim=0)
                target -= target.mean()
                bias.lerp_(target, 0.5)  # halfway each step: damps batch-to-batch noise
            self._last_scores = None

    @torch.no_grad()
    def _record(self, rec, B, T, scores, experts, weights, z) -> None:
        i, E = self.layer_idx, self.config.num_experts
        shape = lambda t: t.view(B, T, -1)  # noqa: E731
        rec.put_tokens(f"moe.{i}.scores", shape(scores), ("batch", "token", "expert"))
        rec.put_tokens(f"moe.{i}.experts", shape(experts), ("batch", "token", "rank"))
        rec.put_tokens(f"moe.{i}.weights", shape(weights), ("batch", "token", "rank"))
        rec.put(f"moe.{i}.load", torch.bincount(experts.reshape(-1), minlength=E), ("expert",))
        rec.put(f"moe.{i}.bias", self.gate.e_score_correction_bias, ("expert",))
        if rec.wants("latent"):
            rec.put_tokens(f"moe.{i}.latent", shape(z), ("batch", "token", "latent"))
