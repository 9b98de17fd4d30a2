"""The model's wing: config, presets, the HF config mapping, hook points, the decoder, its layers and decode cache.

Imports nothing from ``k3core.interp`` and nothing from ``k3core.loading`` at module level."""
