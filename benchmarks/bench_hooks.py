"""Hook points cost nothing when unused; record() is no slower than before hooks (k3-mini, side by side).

Rows (best of N, interleaved round-robin in one process):

- empty hook context: a forward inside ``hooks()`` (a context with no hook) vs a plain forward;
- one reader: a context with a reader on ``logits`` only, so every other point pays its lookup (the cost of
  the hook points themselves) vs a plain forward;
- chunk-state readers: a reader on every KDA layer's ``kda.chunk_state`` (the state at each chunk end, handed
  out by the forward's own state loop) vs a plain forward;
- record(model) now vs record(model) of the reference commit (default ``main``): the reference's
  ``k3core`` is extracted with ``git archive`` into a temporary folder and imported under another package
  name, so both versions run in this process on identical weights (the reference model is built from the
  current one's state dict) and inputs;
- plain forward now vs the reference's plain forward (the residual / hook refactor must not slow it).
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from k3core.interp.catalogue import hook_points
from k3core.interp.recorder import record
from k3core.modeling.hooks import hooks
from k3core.modeling.model import K3ForCausalLM

from .common import Row, side_by_side

REPO = Path(__file__).resolve().parent.parent


def reference_k3core(ref: str = "main") -> tuple[object, object] | str:
    """(model module, trace module) of ``ref``'s k3core, imported as ``k3core_ref``; or why not."""
    folder = Path(tempfile.mkdtemp(prefix="k3lab-ref-"))
    try:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", ref, "k3core"], capture_output=True, check=True, timeout=60
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"no reference k3core at {ref!r} ({exc})"
    (folder / "k3core").rename(folder / "k3core_ref")
    sys.path.insert(0, str(folder))
    try:
        model_mod = importlib.import_module("k3core_ref.model")
        try:  # the recorder's module: k3core.interp.recorder since the subsystem layout, k3core.trace before
            return model_mod, importlib.import_module("k3core_ref.interp.recorder")
        except ModuleNotFoundError:
            return model_mod, importlib.import_module("k3core_ref.trace")
    finally:
        sys.path.remove(str(folder))


def time_hooks(preset: str = "k3-mini", T: int = 512, repeat: int = 9, ref: str = "main") -> dict:
    torch.manual_seed(0)
    model = K3ForCausalLM.from_config(preset).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))

    def plain():
        with torch.inference_mode():
            model(ids)

    def empty():
        with torch.inference_mode(), hooks():
            model(ids)

    def one_hook():  # every point passes through HookContext.point; one of them has a (trivial) reader
        with torch.inference_mode(), hooks(read={"logits": lambda value, name, info: None}):
            model(ids)

    chunk_points = [n for n in hook_points(model.config) if n.endswith("kda.chunk_state")]

    def chunk_states():
        with torch.inference_mode(), hooks(read=dict.fromkeys(chunk_points, lambda value, name, info: None)):
            model(ids)

    def recorded():
        with torch.inference_mode(), record(model):
            model(ids)

    fns = {"plain": plain, "empty": empty, "one_hook": one_hook, "chunk_states": chunk_states, "recorded": recorded}
    reference = reference_k3core(ref)
    note = ""
    if isinstance(reference, str):
        note = reference
    else:
        ref_model_mod, ref_trace_mod = reference
        old = ref_model_mod.K3ForCausalLM(ref_model_mod.K3Config.from_dict(model.config.to_dict())).eval()
        old.load_state_dict(model.state_dict())
        with torch.inference_mode():
            same = torch.equal(old(ids).logits, model(ids).logits)
        note = f"reference {ref}: logits {'bitwise equal' if same else 'DIFFER'}"

        def ref_plain():
            with torch.inference_mode():
                old(ids)

        def ref_recorded():
            with torch.inference_mode(), ref_trace_mod.record(old):
                old(ids)

        fns.update(ref_plain=ref_plain, ref_recorded=ref_recorded)
    times = side_by_side(fns, repeat=repeat)
    times["note"] = note
    return times


def run(quick: bool = False) -> list[Row]:
    T, repeat = (256, 5) if quick else (512, 15)
    t = time_hooks(T=T, repeat=repeat)
    case = f"k3-mini T={T} B=1"

    def row(bench: str, value: str, value_label: str, base: str, base_label: str, note: str = "") -> Row:
        ratio = t[value] / t[base]
        note = f"best of {repeat}" + (f"; {note}" if note else "")
        return Row(bench, case, t[value], value_label, t[base], base_label, "s", ratio, "<= 1.02", ratio <= 1.02, note)

    rows = [row("hooks: empty context", "empty", "forward in hooks()", "plain", "plain forward")]
    rows.append(row("hooks: one reader", "one_hook", "forward, a reader on logits", "plain", "plain forward"))
    rows.append(row("hooks: chunk-state readers", "chunk_states", "forward, readers on kda.chunk_state", "plain",
                    "plain forward"))  # fmt: skip
    if "ref_recorded" in t:
        rows.append(row("hooks: record() vs main", "recorded", "record(model) now", "ref_recorded",
                        "record(model) at main", t["note"]))  # fmt: skip
        rows.append(row("hooks: plain forward vs main", "plain", "forward now", "ref_plain", "forward at main"))
    return rows
