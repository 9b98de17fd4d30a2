"""Upload: add your own checkpoint (config.json + model.safetensors) to the run picker."""

from __future__ import annotations

import streamlit as st

from app import caching, page, uploads
from app.inputs import InputError, current_inputs
from k3core.checkpoint import CheckpointError

page.page_header(
    "Upload a checkpoint",
    "Add your own run: a k3lab / Hugging Face style checkpoint folder's config.json and model.safetensors (or "
    "shards with model.safetensors.index.json), optionally metrics.json and README.md. Files are checked before "
    "the run is added; pickle files (.bin/.pt) are never unpickled, only read as plain tensors when "
    "torch.load(weights_only=True) accepts them.",
)

inputs = current_inputs()
ss = st.session_state

with st.form("k3lab_upload", clear_on_submit=True):
    name = st.text_input("Name", placeholder="my-run", key="k3lab_upload_name")
    files = st.file_uploader(
        "Checkpoint files",
        accept_multiple_files=True,
        key="k3lab_upload_files",
        type=["json", "safetensors", "md", "bin", "pt"],
    )
    add = st.form_submit_button("Add run", type="primary")

if add:
    run = None
    try:
        run = uploads.save_upload([(f.name, f.getvalue()) for f in files or []], name)
        caching.load_run(run, inputs.device if inputs else "cpu", inputs.dtype if inputs else "float32")
    except (CheckpointError, InputError) as exc:
        if run is not None:
            uploads.remove_upload(run)
        st.error(f"This checkpoint cannot be used: {exc}")
    else:
        ss.setdefault("k3lab_uploaded", []).append(run)
        ss["k3lab_pending_run"] = run.path
        ss["k3lab_upload_ok"] = f"Added **{run.label}** and selected it in the sidebar."
        st.rerun()

if ss.get("k3lab_upload_ok"):
    st.success(ss.pop("k3lab_upload_ok"))

uploaded = ss.get("k3lab_uploaded", [])
if uploaded:
    st.markdown("#### Your uploads (this session)")
    for i, run in enumerate(list(uploaded)):
        c1, c2 = st.columns([5, 1])
        c1.markdown(f"**{run.label}** · `{run.path}`")
        if c2.button("Remove", key=f"k3lab_remove_{i}"):
            uploads.remove_upload(run)
            uploaded.remove(run)
            st.rerun()
else:
    st.caption("No uploads yet. Uploaded runs live in a temporary folder for this session.")
