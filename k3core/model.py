"""The K3 decoder, top to bottom.

    embed -> [layer: residual-in -> RMSNorm -> KDA | MLA -> residual -> RMSNorm -> dense FFN | LatentMoE]
          -> (output depth mix) -> RMSNorm -> LM head (untied)

The residual stream is one of four modes (``config.residual``):

- ``block_attnres`` (K3): each sub-layer input is a softmax mix over depth of a bank of completed
  block sums plus the running partial sum P (arXiv 2603.15031); see ``K3Model._forward_block``.
- ``full_attnres``: the mix runs over the embedding and every earlier sub-layer output.
- ``scale_bias``: h = h + scale_l * f(RMSNorm(h)) + bias_l with learned per-channel scale and bias.
- ``plain``: pre-norm residual h = h + f(RMSNorm(h)).

State-dict keys follow the published Kimi K3 / Kimi Linear names (``model.layers.i.self_attn...``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import trace as _trace
from .cache import K3Cache
from .checkpoint import build_meta_model, load_pretrained, save_pretrained
from .checkpoint_files import CheckpointFiles
from .config import K3Config
from .generate import generate as _generate
from .layers.ffn import GatedMLP
from .layers.kda import KDACache, KimiDeltaAttention
from .layers.mla import MLACache, MultiHeadLatentAttention
from .layers.moe import LatentMoE
from .layers.norm import RMSNorm
from .ops.attnres import attnres_mix
from .placement import Plan, load_placed, plan_for_model
from .presets import PRESETS, from_preset
from .trace import TraceNames


def scale_bias_init(config: K3Config, layer_idx: int) -> float:
    """Initial residual scale: 1.0 at the first layer falling linearly to 0.9 at the last."""
    depth = layer_idx / max(config.num_hidden_layers - 1, 1)
    return 1.0 - 0.1 * depth


@dataclass
class K3Output:
    logits: torch.Tensor
    loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    cache: K3Cache | None = None


class K3DecoderLayer(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        D = config.hidden_size
        self.is_mla = config.is_mla_layer(layer_idx)
        self.is_moe = config.is_moe_layer(layer_idx)
        self.input_layernorm = RMSNorm(D, config.rms_norm_eps)
        self.self_attn = (MultiHeadLatentAttention if self.is_mla else KimiDeltaAttention)(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(D, config.rms_norm_eps)
        if self.is_moe:
            self.block_sparse_moe = LatentMoE(config, layer_idx)
        else:
            self.mlp = GatedMLP(config, D, config.scaled_width(config.intermediate_size, layer_idx))
        if config.residual in ("block_attnres", "full_attnres"):
            # Pseudo-query (D -> 1 linear, zero-initialised: the first mix is a uniform average) + key norm.
            self.self_attention_res_norm = RMSNorm(D, config.rms_norm_eps)
            self.self_attention_res_proj = nn.Linear(D, 1, bias=False)
            self.mlp_res_norm = RMSNorm(D, config.rms_norm_eps)
            self.mlp_res_proj = nn.Linear(D, 1, bias=False)
        elif config.residual == "scale_bias":
            init = scale_bias_init(config, layer_idx)
            self.self_attention_res_scale = nn.Parameter(torch.full((D,), init))
            self.self_attention_res_bias = nn.Parameter(torch.zeros(D))
            self.mlp_res_scale = nn.Parameter(torch.full((D,), init))
            self.mlp_res_bias = nn.Parameter(torch.zeros(D))

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if self.is_moe else self.mlp

    def attention(self, h: torch.Tensor, cache: KDACache | MLACache | None = None) -> torch.Tensor:
        return self.self_attn(self.input_layernorm(h), cache)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.ffn(self.post_attention_layernorm(h))


class K3Model(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        D = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, D)
        self.layers = nn.ModuleList(K3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(D, config.rms_norm_eps)
        if config.residual in ("block_attnres", "full_attnres"):
            self.output_attn_res_norm = RMSNorm(D, config.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(D, 1, bias=False)

    # -------------------------------------------------------------- depth mixing
    def _mix(
        self, site: str, proj: nn.Linear, norm: RMSNorm, sources: list[torch.Tensor], names: list[str], rec
    ) -> torch.Tensor:
        want = rec is not None and rec.wants("attnres")
        # Layers may sit on different devices (device="auto"): the mix runs where its pseudo-query is.
        dev = proj.weight.device
        stacked = torch.stack([s.to(dev) for s in sources])
        out = attnres_mix(proj.weight[0], stacked, norm.weight, norm.eps, return_weights=want)
        if not want:
            return out
        mixed, p = out
        rec.put_tokens(TraceNames.attnres(site), p.permute(1, 2, 0), ("batch", "token", "source"))
        rec.put(TraceNames.attnres_query_norm(site), proj.weight.detach().float().norm().reshape(()), ())
        rec.trace.meta.setdefault(TraceNames.ATTNRES_SOURCES_META, {})[site] = list(names)
        return mixed

    def forward(self, input_ids: torch.Tensor, cache: K3Cache | None = None) -> torch.Tensor:
        """Final hidden states after the last RMSNorm, [B, T, D]."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids has no tokens (shape [batch, 0])")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"token ids must lie in 0..{self.config.vocab_size - 1}")
        rec = _trace.current()
        if rec is not None:
            rec.start_forward(input_ids)
        x = self.embed_tokens(input_ids)
        mode = self.config.residual
        if mode == "block_attnres":
            final = self._forward_block(x, cache, rec)
        elif mode == "full_attnres":
            final = self._forward_full(x, cache, rec)
        else:
            final = self._forward_additive(x, cache, rec)
        if rec is not None:
            rec.hidden(final)
        return self.norm(final)

    def _layer_cache(self, cache: K3Cache | None, i: int):
        return None if cache is None else cache.layers[i]

    def _forward_additive(self, h, cache, rec):
        scale_bias = self.config.residual == "scale_bias"
        for i, layer in enumerate(self.layers):
            if rec is not None:
                rec.hidden(h)
                if scale_bias and rec.wants("attnres"):
                    for side, module_side in (("attn", "self_attention_res"), ("mlp", "mlp_res")):
                        for kind in ("scale", "bias"):
                            value = getattr(layer, f"{module_side}_{kind}")
                            rec.put(TraceNames.residual(i, side, kind), value, ("hidden",))
            a = layer.attention(h, self._layer_cache(cache, i))
            h = h.to(a.device)  # no-op unless layers sit on different devices
            h = h + a * layer.self_attention_res_scale + layer.self_attention_res_bias if scale_bias else h + a
            m = layer.feed_forward(h)
            h = h + m * layer.mlp_res_scale + layer.mlp_res_bias if scale_bias else h + m
        return h

    def _forward_block(self, x, cache, rec):
        """Block AttnRes: a bank of completed block sums + the running partial sum P (P starts as x)."""
        size = self.config.attn_res_block_size
        bank: list[torch.Tensor] = []
        names: list[str] = []
        partial: torch.Tensor | None = x
        partial_name = "embedding"
        for i, layer in enumerate(self.layers):
            if bank:
                site = TraceNames.attnres_site(i, "attn")
                h = self._mix(
                    site,
                    layer.self_attention_res_proj,
                    layer.self_attention_res_norm,
                    bank + [partial],
                    names + [partial_name],
                    rec,
                )
            else:
                h = partial
            if rec is not None:
                rec.hidden(h)
            if i % size == 0:
                bank.append(partial)
                names.append(partial_name)
                partial, partial_name = None, f"block {i // size + 1} (partial)"
            a = layer.attention(h, self._layer_cache(cache, i))
            partial = a if partial is None else partial.to(a.device) + a
            h = self._mix(
                TraceNames.attnres_site(i, "mlp"),
                layer.mlp_res_proj,
                layer.mlp_res_norm,
                bank + [partial],
                names + [partial_name],
                rec,
            )
            ffn = layer.feed_forward(h)
            partial = partial.to(ffn.device) + ffn
            if (i + 1) % size == 0 or i + 1 == len(self.layers):
                partial_name = partial_name.replace(" (partial)", "")
        return self._mix(
            TraceNames.OUTPUT_SITE,
            self.output_attn_res_proj,
            self.output_attn_res_norm,
            bank + [partial],
            names + [partial_name],
            rec,
        )

    def _forward_full(self, x, cache, rec):
        """Full AttnRes: every sub-layer input mixes the embedding and all earlier sub-layer outputs."""
        sources, names = [x], ["embedding"]
        for i, layer in enumerate(self.layers):
            h = (
                x
                if len(sources) == 1
                else self._mix(
                    TraceNames.attnres_site(i, "attn"),
                    layer.self_attention_res_proj,
                    layer.self_attention_res_norm,
                    sources,
                    names,
                    rec,
                )
            )
            if rec is not None:
                rec.hidden(h)
            sources.append(layer.attention(h, self._layer_cache(cache, i)))
            names.append(f"L{i}.attn")
            site = TraceNames.attnres_site(i, "mlp")
            h = self._mix(site, layer.mlp_res_proj, layer.mlp_res_norm, sources, names, rec)
            sources.append(layer.feed_forward(h))
            names.append(f"L{i}.ffn")
        out_proj, out_norm = self.output_attn_res_proj, self.output_attn_res_norm
        return self._mix(TraceNames.OUTPUT_SITE, out_proj, out_norm, sources, names, rec)


class K3ForCausalLM(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        self.model = K3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.lm_head.weight.is_meta:
            return  # shapes only (device="meta"): no values to initialise; after to_empty(), call this again
        std = self.config.initializer_range
        out_std = std / math.sqrt(2 * self.config.num_hidden_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                if name.endswith("res_proj"):
                    nn.init.zeros_(module.weight)
                elif name.endswith(("o_proj", "down_proj", "routed_expert_up_proj")):
                    nn.init.normal_(module.weight, 0.0, out_std)
                else:
                    nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, nn.Conv1d):
                nn.init.normal_(module.weight, 0.0, 1.0 / math.sqrt(module.kernel_size[0]))
            elif isinstance(module, KimiDeltaAttention):
                module.reset_gate_parameters()
            elif isinstance(module, LatentMoE):
                nn.init.normal_(module.gate.weight, 0.0, std)
                module.gate.e_score_correction_bias.zero_()
                nn.init.normal_(module.experts.w1, 0.0, std)
                nn.init.normal_(module.experts.w3, 0.0, std)
                nn.init.normal_(module.experts.w2, 0.0, out_std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, K3DecoderLayer) and self.config.residual == "scale_bias":
                init = scale_bias_init(self.config, module.layer_idx)
                for site in ("self_attention_res", "mlp_res"):
                    getattr(module, f"{site}_scale").fill_(init)
                    getattr(module, f"{site}_bias").zero_()

    # -------------------------------------------------------------- construction / IO
    @classmethod
    def from_config(
        cls, config: K3Config | str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> K3ForCausalLM:
        """Build a randomly initialised model. ``device="meta"`` builds shapes only (any size)."""
        if isinstance(config, str):
            config = from_preset(config)
        if dtype is None:
            with torch.device(device):
                return cls(config)
        # Build directly in the target dtype: building in fp32 then casting needs twice the memory.
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = cls(config)
        finally:
            torch.set_default_dtype(previous)
        return model.to(dtype=dtype)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        progress: Callable[[int, int], None] | bool | None = None,
        max_memory: dict[Any, int | str] | None = None,
        offload_folder: str | Path | None = None,
        stream: bool = False,
    ) -> K3ForCausalLM:
        """Stream a checkpoint folder in (any size; see ``k3core.checkpoint.load_pretrained``).

        ``device="auto"`` places layers over every GPU, then CPU, then ``offload_folder`` (accelerate);
        tensors of the keep-fp32 rule stay fp32 whatever ``dtype``; ``progress``: (bytes done, total)
        callback, or True for a tqdm bar. ``stream=True``: run from the checkpoint files within
        ``max_memory`` (e.g. ``{"cpu": "8GB"}``) on ``device``: routed experts read as the router chooses them,
        dense parts resident when they fit, else read module by module; nothing copied anywhere
        (``k3core.streamed.load_streamed``; the plan is ``model.streaming.plan``). Raises CheckpointError."""
        if stream:
            from .streamed import load_streamed

            return load_streamed(path, cls, device=device, dtype=dtype, max_memory=max_memory or "8GB")
        if str(device) == "auto" or max_memory is not None:
            return load_placed(
                path,
                cls,
                device="auto",
                dtype=dtype,
                max_memory=max_memory,
                offload_folder=offload_folder,
                progress=progress,
            )
        return load_pretrained(path, cls, device=device, dtype=dtype, progress=progress)

    @classmethod
    def plan_placement(
        cls,
        path_or_config: str | Path | K3Config,
        device: str | torch.device = "auto",
        dtype: torch.dtype | None = None,
        max_memory: dict[Any, int | str] | None = None,
    ) -> Plan:
        """Where ``from_pretrained(path, device, dtype)`` would put each layer and the bytes per device,
        computed on the meta device before anything is loaded (a checkpoint folder, a config or a preset)."""
        files = None
        if isinstance(path_or_config, K3Config):
            config = path_or_config
        elif isinstance(path_or_config, str) and path_or_config in PRESETS:
            config = from_preset(path_or_config)
        else:
            files = CheckpointFiles.open(path_or_config)
            config = files.config
        plan = plan_for_model(build_meta_model(cls, config, dtype), device, max_memory)
        if files is not None:
            plan.stored_bytes_by_format = files.bytes_by_format()
            plan.stored_parameters = files.num_parameters
        return plan

    def save_pretrained(
        self, path: str | Path, max_shard_bytes: int = 2 * 1024**3, config_format: str = "auto"
    ) -> Path:
        """config.json + safetensors (sharded above ``max_shard_bytes``); Kimi-Linear-type configs in
        transformers' format unless ``config_format="k3lab"``."""
        return save_pretrained(self, path, max_shard_bytes=max_shard_bytes, config_format=config_format)

    # -------------------------------------------------------------- forward
    def moe_layers(self) -> list[LatentMoE]:
        return [layer.block_sparse_moe for layer in self.model.layers if layer.is_moe]

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        cache: K3Cache | None = None,
    ) -> K3Output:
        """``labels``: Hugging Face style (same positions as input_ids, shifted here);
        ``targets``: already aligned with input_ids (nanoGPT style). -100 is ignored in both."""
        for name, t in (("labels", labels), ("targets", targets)):
            if t is not None and tuple(t.shape) != tuple(input_ids.shape):
                raise ValueError(
                    f"{name} must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(t.shape)}"
                )
        hidden = self.model(input_ids, cache=cache)
        logits = self.lm_head(hidden)
        if labels is not None:
            targets = F.pad(labels[:, 1:], (0, 1), value=-100)
        if targets is not None:
            targets = targets.to(logits.device)
        loss = aux = None
        if targets is not None:
            live = targets[targets != -100]
            if live.numel() and (int(live.min()) < 0 or int(live.max()) >= self.config.vocab_size):
                raise ValueError(f"labels/targets must lie in 0..{self.config.vocab_size - 1} (or be -100)")
            nll = F.cross_entropy(
                logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none"
            ).view_as(targets)
            valid = targets != -100
            loss = nll.sum() / valid.sum().clamp_min(1)
            rec = _trace.current()
            if rec is not None and rec.wants("loss"):
                rec.put_tokens(TraceNames.TOKEN_NLL, nll.masked_fill(~valid, float("nan")), ("batch", "token"))
            if self.config.balancing == "aux_loss" and self.training:
                parts = [m.aux_loss for m in self.moe_layers() if m.aux_loss is not None]
                if parts:
                    aux = torch.stack(parts).mean()
        return K3Output(logits=logits, loss=loss, aux_loss=aux, cache=cache)

    @torch.no_grad()
    def update_router_biases(self) -> None:
        for moe in self.moe_layers():
            moe.update_bias()

    def num_parameters(self, active: bool = False) -> int:
        """Total parameters, or parameters touched per token (routed experts counted k of E)."""
        total = sum(p.numel() for p in self.parameters())
        if not active:
            return total
        inactive = 0
        for moe in self.moe_layers():
            E, k = self.config.num_experts, self.config.num_experts_per_token
            per_expert = sum(getattr(moe.experts, w)[0].numel() for w in moe.experts.WEIGHTS)
            inactive += (E - k) * per_expert
        return total - inactive

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 64, **kwargs: Any) -> torch.Tensor:
        """Hugging Face style shortcut for :func:`k3core.generate.generate` (same arguments)."""
        return _generate(self, input_ids, max_new_tokens=max_new_tokens, **kwargs)
