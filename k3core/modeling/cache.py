"""The decode cache of a whole model: one KDA or MLA cache per layer (see k3core/generation/decode.py for use)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import K3Config
from .layers.kda import KDACache
from .layers.mla import MLACache


@dataclass
class K3Cache:
    """Per-layer decode caches: KDA layers hold a fixed-size state, MLA layers a growing latent."""

    layers: list[KDACache | MLACache] = field(default_factory=list)

    @classmethod
    def for_config(cls, config: K3Config) -> K3Cache:
        return cls([MLACache() if config.is_mla_layer(i) else KDACache() for i in range(config.num_hidden_layers)])

    @property
    def seen_tokens(self) -> int:
        return self.layers[0].seen_tokens if self.layers else 0

    def nbytes(self) -> int:
        """Bytes actually allocated by the cache tensors."""
        return sum(c.nbytes() for c in self.layers)
