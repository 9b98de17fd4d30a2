"""Decode-cache bytes: the K3 layout (KDA + MLA) vs the same model with every layer MLA.

Bytes are summed over the cache tensors actually allocated (``K3Cache.nbytes()``: numel * element_size)
by ``k3core.generation.decode.build_decode_cache``: each layer's own attention code fills its cache from a short
prefill, then every MLA latent is allocated at the full length [B, T, kv_lora + rope] (``torch.empty``;
KDA caches do not depend on length). No formula is involved.

- k3-small: the attention layers are built on the CPU in bf16 and the caches are real CPU tensors
  (``torch.empty`` reserves the memory; Linux only backs pages that are touched).
- kimi-k3: built on the ``meta`` device (shapes and dtypes, no storage): this machine cannot hold the
  13 GB all-MLA cache at 128K tokens. numel * element_size of the meta tensors is the same count.
"""

from __future__ import annotations

from k3core.generation.decode import decode_cache_bytes
from k3core.modeling.config import K3Config
from k3core.modeling.presets import from_preset

from .common import Row

LENGTHS = (4096, 32768, 131072)


def all_mla(config: K3Config) -> K3Config:
    """The same config with every layer MLA (full_attn_layers = 1..L)."""
    return config.replace(full_attn_layers=list(range(1, config.num_hidden_layers + 1)))


def cache_rows(preset: str, device: str, lengths=LENGTHS, target_at: int = 131072) -> list[Row]:
    cfg = from_preset(preset)
    rows = []
    for T in lengths:
        k3 = decode_cache_bytes(cfg, T, device=device)
        mla = decode_cache_bytes(all_mla(cfg), T, device=device)
        ratio = k3 / mla
        rows.append(
            Row(
                "decode cache bytes",
                f"{preset} T={T // 1024}K B=1 bf16 ({device})",
                k3,
                "K3 layout",
                mla,
                "all-MLA",
                "bytes",
                ratio,
                target="<= 0.30" if T == target_at else "",
                ok=(ratio <= 0.30) if T == target_at else None,
                note="KDA: fp32 state + conv tail, constant; MLA: (kv_lora+rope) per token",
            )
        )
    return rows


def run(quick: bool = False) -> list[Row]:
    rows = cache_rows("k3-small", "cpu")
    rows += cache_rows("kimi-k3", "meta", lengths=(131072,) if quick else LENGTHS)
    return rows
