"""The Experiment page's edit menus (``app/page_scripts/experiment.py``): an edit built from its kind, target, operation
and fields (``k3core.interp.interventions.edit_from_dict``), checked against the config, and added to the session's
list of edits."""

from __future__ import annotations

import streamlit as st

from app.render.errors import plain
from app.state import experiment_choices as ex
from k3core.interp.edit_kinds import EditError, KDAEdit
from k3core.interp.interventions import compile_edits, edit_from_dict
from k3core.modeling.config import K3Config


def position_range(T: int, key: str, what: str = "Positions") -> tuple[list[int] | None, str | None]:
    """A [from, to) range of the ``T`` token positions (the whole text: None), with an error sentence when it is
    empty."""
    cols = st.columns(2)
    start = cols[0].number_input(f"{what} from", 0, T - 1, 0, key=f"k3lab_exp_from_{key}")
    stop = cols[1].number_input(f"{what} to (excluded)", 1, T, T, key=f"k3lab_exp_to_{key}")
    if int(start) >= int(stop):
        return None, f"{what} from {int(start)} to {int(stop)} is empty: 'from' must be below 'to'"
    return (None if (int(start), int(stop)) == (0, T) else [int(start), int(stop)]), None


def edit_form(config: K3Config, attnres_sources: dict[str, list], T: int, edits: list[dict]) -> None:
    """The edit menus: kind, what it acts on and the operation (outside the form: the fields below depend on them),
    then the fields that operation reads in a form whose button adds the edit to ``edits`` (the session's list; a
    duplicate is refused). ``attnres_sources``: the trace's depth sources per AttnRes site; ``T``: the text's tokens."""
    kinds = [k for k in ex.KINDS if k != "attnres" or config.residual.endswith("attnres")]
    kinds = [k for k in kinds if k not in ("moe",) or ex.layers_with(config, "moe.selection")]
    kinds = [k for k in kinds if k != "mla" or ex.layers_with(config, "mla.key_mask")]
    c = st.columns(3)
    kind = c[0].selectbox("Edit", kinds, format_func=ex.KINDS.get, key="k3lab_exp_kind")
    data: dict = {"kind": kind}
    problem = None
    if kind == "attnres":
        sites = list(attnres_sources)
        site = c[1].selectbox("Site", sites, key="k3lab_exp_site")
        sources = attnres_sources[site]
        with st.form("k3lab_exp_form_attnres"):
            mode = st.selectbox("Depth weights", ("uniform", "one_hot", "mask"), key="k3lab_exp_mode")
            picked = st.multiselect("Source(s) (one-hot: the first; mask: all)", sources, key="k3lab_exp_sources")
            tokens, problem = position_range(T, "attnres")
            add = st.form_submit_button("Add edit", type="primary")
        data.update(site=site, mode=mode, sources=picked, tokens=tokens)
    else:
        point = {"moe": "moe.selection", "kda": "kda.g", "mla": "mla.key_mask"}.get(kind)
        op = None
        if kind == "value":
            points = ex.value_points(config)
            point = c[1].selectbox("Hook point", points, key="k3lab_exp_point")
        else:
            ops = {"moe": ("ban", "force", "uniform", "bias_off", "shared_off"), "kda": KDAEdit.OPS}.get(
                kind, ("mask_keys",)
            )
            op = c[2].selectbox("Operation", ops, format_func=ex.OP_LABELS.get, key=f"k3lab_exp_op_{kind}")
        layers = ex.layers_with(config, point) if point not in ("embed", "final_resid", "final_norm", "logits") else []
        with st.form(f"k3lab_exp_form_{kind}"):
            cols = st.columns(3)
            if kind == "value":
                chosen = cols[0].multiselect("Layers (none: all)", layers, key="k3lab_exp_layers") if layers else []
                op = cols[1].selectbox("Operation", ("zero", "scale", "add", "replace"), key="k3lab_exp_vop")
                value = cols[2].number_input("Value (factor or number; zero: unused)", value=0.0, key="k3lab_exp_value")
                tokens, problem = position_range(T, "value")
                data.update(point=point, op=op, layers=chosen or None, value=None if op == "zero" else value)
                data["tokens"] = tokens
            else:
                layer = cols[0].selectbox("Layer", layers, key=f"k3lab_exp_layer_{kind}")
                data.update(layer=layer, op=op)
                if kind == "moe":
                    if op in ("ban", "force"):
                        data["experts"] = cols[1].multiselect(
                            "Experts", list(range(config.num_experts)), key="k3lab_exp_experts"
                        )
                    if op != "bias_off":  # the selection bias is one vector: it has no positions
                        data["tokens"], problem = position_range(T, "moe")
                elif kind == "kda":
                    if op in ("pin_g", "scale_g", "scale_beta", "scale_chunk_state"):
                        what = "g (<= 0)" if op == "pin_g" else "Factor"
                        data["value"] = cols[1].number_input(what, value=0.0, key="k3lab_exp_kvalue")
                    if op == "reset_state":
                        where = cols[1].number_input(
                            "Forget the state before position", 0, T - 1, min(1, T - 1), key="k3lab_exp_pos"
                        )
                        data["tokens"] = [int(where), int(where) + 1]
                    elif op in ("reset_chunk_state", "scale_chunk_state"):
                        chunk_names = ex.chunk_labels(T, config.kda_chunk_size)
                        data["chunks"] = st.multiselect(
                            "Chunks", list(chunk_names), format_func=chunk_names.get, key="k3lab_exp_chunks"
                        )
                    else:
                        data["tokens"], problem = position_range(T, "kda")
                else:
                    start = cols[1].number_input("First key masked", 0, T - 1, 0, key="k3lab_exp_k0")
                    stop = cols[2].number_input("Keys masked up to (excluded)", 1, T, 1, key="k3lab_exp_k1")
                    data["keys"] = [int(start), int(stop)]
                    data["queries"], problem = position_range(T, "mla", "Queries")
            add = st.form_submit_button("Add edit", type="primary")
    if add:
        if problem:
            st.error(f"This edit cannot be applied: {problem}")
            return
        try:
            edit = edit_from_dict(data)
            compile_edits(config, [edit])
        except EditError as exc:
            st.error(f"This edit cannot be applied: {plain(exc)}")
            return
        if edit.to_dict() in edits:  # e.g. Enter in a number field submitted the form, then "Add edit" again
            st.warning(f"`{edit.describe()}` is already in the list: not added twice.")
            return
        edits.append(edit.to_dict())
        st.rerun()
