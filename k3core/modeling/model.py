"""The K3 decoder, top to bottom.

    embed -> [layer: residual-in -> RMSNorm -> KDA | MLA -> residual -> RMSNorm -> dense FFN | LatentMoE]
          -> (output depth mix) -> RMSNorm -> LM head (untied)

The residual stream is one of four modes (``config.residual``):

- ``block_attnres`` (K3): each sub-layer input is a softmax mix over depth of a bank of completed
  block sums plus the running partial sum P (arXiv 2603.15031); see ``k3core.modeling.layers.residual.DepthStream``.
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
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..data.batches import IGNORE_INDEX
from .cache import K3Cache
from .config import K3Config
from .hooks import HookContext, HookNames, HookPoint, active, point
from .layers.ffn import GatedMLP
from .layers.kda import KDACache, KimiDeltaAttention
from .layers.mla import MLACache, MultiHeadLatentAttention
from .layers.moe import LatentMoE
from .layers.norm import RMSNorm
from .layers.residual import (
    FINAL_STREAM,
    STREAM,
    DepthStream,
    Source,
    add_output,
    depth_mix,
    offer_stream,
    read_input,
    scale_bias_init,
)
from .loading_state import LoadingState
from .presets import PRESETS, from_preset

if TYPE_CHECKING:
    from ..loading.placement import Plan

_BTD = ("batch", "token", "hidden")

# The hook points of the decoder (k3core.modeling.hooks): model-wide ones and those of every decoder layer.
TOKENS = HookPoint("tokens", ("batch", "token"), "input ids (read only)", per_layer=False)
EMBED = HookPoint("embed", _BTD, "embedding output", per_layer=False)
RESID_IN = HookPoint("resid_in", _BTD, "the attention sub-layer's input (pre-norm)")
MIXER_IN = HookPoint("mixer_in", _BTD, "KDA/MLA input (after RMSNorm)")
MIXER_OUT = HookPoint("mixer_out", _BTD, "KDA/MLA output")
FFN_IN = HookPoint("ffn_in", _BTD, "the FFN sub-layer's input (pre-norm)")
FFN_OUT = HookPoint("ffn_out", _BTD, "dense FFN or MoE output")
FINAL_RESID = HookPoint("final_resid", _BTD, "the last hidden state, before the final norm", per_layer=False)
FINAL_NORM = HookPoint("final_norm", _BTD, "after the final RMSNorm", per_layer=False)
LOGITS = HookPoint("logits", ("batch", "token", "vocab"), "LM head output", per_layer=False)
TOKEN_NLL = HookPoint(
    "token_nll", ("batch", "token"), "next-token loss (with labels; NaN where ignored; read only)", per_layer=False
)


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
        if config.uses_attnres:
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
        """The attention sub-layer on its (pre-norm) input h: KDA or MLA of RMSNorm(h)."""
        ctx, i = active(), self.layer_idx
        x = point(ctx, MIXER_IN.at(i), self.input_layernorm(h))
        return point(ctx, MIXER_OUT.at(i), self.self_attn(x, cache))

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        """The FFN sub-layer on its (pre-norm) input h: dense FFN or LatentMoE of RMSNorm(h)."""
        return point(active(), FFN_OUT.at(self.layer_idx), self.ffn(self.post_attention_layernorm(h)))

    def forward(self, stream: DepthStream, cache: KDACache | MLACache | None = None) -> DepthStream:
        """One pre-norm decoder layer, h = h + attention(norm(h)); h = h + ffn(norm(h)), on the residual stream of
        any mode: each sub-layer's input is read from the stream (AttnRes: a depth mix) and its output added."""
        ctx, i, config = active(), self.layer_idx, self.config
        stream = offer_stream(ctx, STREAM.at(i), stream)
        h = point(ctx, RESID_IN.at(i), read_input(config, self, "attn", stream, ctx))
        stream = add_output(config, self, "attn", stream, self.attention(h, cache))
        h = point(ctx, FFN_IN.at(i), read_input(config, self, "mlp", stream, ctx))
        return add_output(config, self, "mlp", stream, self.feed_forward(h))


class K3Model(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        D = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, D)
        self.layers = nn.ModuleList(K3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(D, config.rms_norm_eps)
        if config.uses_attnres:
            self.output_attn_res_norm = RMSNorm(D, config.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(D, 1, bias=False)

    def forward(self, input_ids: torch.Tensor, cache: K3Cache | None = None) -> torch.Tensor:
        """Final hidden states after the last RMSNorm, [B, T, D]."""
        stream = self.begin(input_ids)
        for i, layer in enumerate(self.layers):
            stream = layer(stream, None if cache is None else cache.layers[i])
        return self.end(stream)

    def begin(self, input_ids: torch.Tensor) -> DepthStream:
        """The stream entering layer 0: the checked token ids embedded (a pipeline's first stage runs this)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids has no tokens (shape [batch, 0])")
        # (skipped when compiled: reading the range back to Python breaks the graph; the embedding still refuses)
        in_range_checked = input_ids.numel() and not torch.compiler.is_compiling()
        if in_range_checked and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"token ids must lie in 0..{self.config.vocab_size - 1}")
        hooks = active()
        point(hooks, TOKENS.at(), input_ids)
        return DepthStream.start(point(hooks, EMBED.at(), self.embed_tokens(input_ids)))

    def end(self, stream: DepthStream) -> torch.Tensor:
        """The output depth mix and final RMSNorm of the stream leaving the last layer (a pipeline's last stage)."""
        hooks = active()
        return self.read_out(*offer_stream(hooks, FINAL_STREAM.at(), stream).sources(), hooks)

    def read_out(self, sources: list[torch.Tensor], names: list[Source], hooks: HookContext | None) -> torch.Tensor:
        """The final hidden state of depth sources: the output depth mix (AttnRes; else the last source), then the
        final RMSNorm, through their hook points. ``end`` reads the stream with it; the lens reads earlier depths
        with it, so an edit of the output path (the output site's weights, final_resid, final_norm) acts on both."""
        if self.config.uses_attnres:
            mixed = depth_mix(
                hooks, HookNames.OUTPUT_SITE, self.output_attn_res_proj, self.output_attn_res_norm, sources, names
            )
        else:
            mixed = sources[-1]
        final = point(hooks, FINAL_RESID.at(), mixed)
        return point(hooks, FINAL_NORM.at(), self.norm(final))


class K3ForCausalLM(nn.Module):
    # what loading attached (skipped tensors, placement, offload folder, streaming); None when built from a config
    loading: LoadingState | None = None

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
        trace_estimate: Callable[[Any, int], int] | None = None,
    ) -> K3ForCausalLM:
        """Stream a checkpoint folder in (any size; see ``k3core.loading.pretrained.load_pretrained``).

        ``device="auto"`` places layers over every GPU, then CPU, then ``offload_folder`` (accelerate);
        tensors of the keep-fp32 rule stay fp32 whatever ``dtype``; ``progress``: (bytes done, total)
        callback, or True for a tqdm bar. ``stream=True``: run from the checkpoint files within
        ``max_memory`` (e.g. ``{"cpu": "8GB"}``) on ``device``: routed experts read as the router chooses them,
        dense parts resident when they fit, else read module by module; nothing copied anywhere
        (``k3core.loading.streamed_run.load_streamed``; the plan is ``model.loading.streaming.plan``, which keeps room
        for a default trace when given the recorder's ``trace_estimate``). Raises CheckpointError."""
        # The loading stack is imported when a checkpoint is loaded, not with the model.
        if stream:
            from ..loading.streamed_run import load_streamed

            return load_streamed(
                path, cls, device=device, dtype=dtype, max_memory=max_memory or "8GB", trace_estimate=trace_estimate
            )
        if str(device) == "auto" or max_memory is not None:
            from ..loading.placement import load_placed

            return load_placed(
                path,
                cls,
                device="auto",
                dtype=dtype,
                max_memory=max_memory,
                offload_folder=offload_folder,
                progress=progress,
            )
        from ..loading.pretrained import load_pretrained

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
        from ..loading.folder import CheckpointFiles
        from ..loading.placement import plan_for_model
        from ..loading.pretrained import build_meta_model

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
        from ..loading.pretrained import save_pretrained

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
        ``targets``: already aligned with input_ids (nanoGPT style). IGNORE_INDEX (-100) is ignored in both."""
        for name, t in (("labels", labels), ("targets", targets)):
            if t is not None and tuple(t.shape) != tuple(input_ids.shape):
                raise ValueError(
                    f"{name} must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(t.shape)}"
                )
        hidden = self.model(input_ids, cache=cache)
        return self.head(hidden, labels, targets, cache)

    def head(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        cache: K3Cache | None = None,
    ) -> K3Output:
        """LM head and loss on the final hidden states (``forward`` after the decoder; a pipeline's last stage)."""
        hooks = active()
        logits = point(hooks, LOGITS.at(), self.lm_head(hidden))
        if labels is not None:
            targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        if targets is not None:
            targets = targets.to(logits.device)
        loss = aux = None
        if targets is not None:
            live = None if torch.compiler.is_compiling() else targets[targets != IGNORE_INDEX]  # (as in begin)
            if live is not None and live.numel() and (int(live.min()) < 0 or int(live.max()) >= self.config.vocab_size):
                raise ValueError(f"labels/targets must lie in 0..{self.config.vocab_size - 1} (or be {IGNORE_INDEX})")
            nll = F.cross_entropy(
                logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
            ).view_as(targets)
            valid = targets != IGNORE_INDEX
            loss = nll.sum() / valid.sum().clamp_min(1)
            if hooks is not None:
                point(hooks, TOKEN_NLL.at(), nll.masked_fill(~valid, float("nan")))
            if self.config.balancing == "aux_loss" and self.training:
                parts = [m.aux_loss for m in self.moe_layers() if m.aux_loss is not None]
                if parts:
                    aux = torch.stack(parts).mean()
        return K3Output(logits=logits, loss=loss, aux_loss=aux, cache=cache)

    def num_parameters(self, active: bool = False) -> int:
        """Total parameters, or parameters touched per token (routed experts counted k of E). Parameters are
        ``nn.Parameter``s (k3core.loading.names.PARAMETER_RULE): the router selection bias, a buffer, is not."""
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
        """Hugging Face style shortcut for :func:`k3core.generation.decode.generate` (same arguments)."""
        from ..generation.decode import generate

        return generate(self, input_ids, max_new_tokens=max_new_tokens, **kwargs)
