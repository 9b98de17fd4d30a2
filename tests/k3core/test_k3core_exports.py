"""k3core's top-level names: each is the object of its module, imported on first use (a bare import stays light)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import k3core


def test_every_exported_name_is_its_modules_object():
    import importlib

    for name, module in k3core._EXPORTS.items():
        assert getattr(k3core, name) is getattr(importlib.import_module(f"k3core.{module}"), name), name
    assert sorted(k3core.__all__) == sorted(k3core._EXPORTS)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        k3core.nope  # noqa: B018


def test_a_bare_import_does_not_load_the_model():
    code = "import sys, k3core; print('k3core.modeling.model' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
