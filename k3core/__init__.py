"""k3core: the K3 model, its hook points, recording and interventions.

    from k3core import K3ForCausalLM, record, intervene, MoEEdit
    from k3core.modeling.hooks import hooks        # read / write hook points directly

The names below are imported on first use (``import k3core.loading.folder`` alone stays free of the
model and of torch's start-up cost).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "K3ForCausalLM": "modeling.model",
    "K3Model": "modeling.model",
    "K3DecoderLayer": "modeling.model",
    "K3Output": "modeling.model",
    "K3Config": "modeling.config",
    "from_preset": "modeling.presets",
    "PRESETS": "modeling.presets",
    "K3Cache": "modeling.cache",
    "record": "interp.recorder",
    "Trace": "interp.trace",
    "TraceNames": "interp.trace",
    "names": "interp.trace",
    "HookNames": "modeling.hooks",
    "hook_points": "interp.catalogue",
    "intervene": "interp.interventions",
    "parse_edit": "interp.interventions",
    "edits_from_json": "interp.interventions",
    "edits_to_json": "interp.interventions",
    "EditError": "interp.edit_kinds",
    "ValueEdit": "interp.edit_kinds",
    "AttnResEdit": "interp.edit_kinds",
    "KDAEdit": "interp.edit_kinds",
    "MoEEdit": "interp.edit_kinds",
    "MLAEdit": "interp.edit_kinds",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'k3core' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
