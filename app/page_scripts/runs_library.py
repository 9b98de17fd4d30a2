"""Runs library: add runs (upload files, a folder or a zip; open a folder on the server; a random-init preset),
and rename or delete them. Runs are kept under the k3lab home, so they are there after a reload or a restart."""

from __future__ import annotations

import streamlit as st

from analysis.output.format import format_bytes
from analysis.runs.loading import DTYPES
from app.library import home as library_home
from app.library import memory_fit, run_list, run_messages
from app.library.roots import PathRefused, confine_folder
from app.library.run_folders import LibraryError, describe_folder, human_count, summary_text
from app.render import caching, page_scaffold
from app.render.errors import USER_ERRORS, describe, log, md_escape, plain
from app.state.inputs import current_inputs
from k3core.distributed import rank_plan

page_scaffold.page_header(
    "runs_library",
    "Add your own runs: upload a checkpoint (config.json + model.safetensors, or shards with "
    "model.safetensors.index.json; optionally metrics.json, README.md and tokenizer files), a whole folder or a "
    "zip of it; open a folder on the server by path (the way to bring a checkpoint of any size); or create a fresh "
    "random-init model of a preset. Runs are kept in the runs library and stay after a reload or a restart. "
    "Pickle files (.bin/.pt) are never unpickled, only read as plain tensors when "
    "torch.load(weights_only=True) accepts them.",
)

ss = st.session_state
inputs = current_inputs()
device = inputs.device if inputs else "cpu"
dtype = inputs.dtype if inputs else "float32"
SOURCE_NAMES = {"upload": "uploaded", "path": "folder on the server", "preset": "random-init preset"}
UPLOAD_TYPES = ["json", "safetensors", "md", "bin", "pt", "model", "zip", "npz"]  # npz: trace folders
VALIDATE_LOAD_BYTES = 2 * 1024**3  # uploads up to this size are loaded once to check every tensor

try:
    lib = library_home.library()
except LibraryError as exc:
    st.error(f"The runs library cannot be opened: {plain(exc)}. Start the app with `k3lab app --home DIR`.")
    st.stop()


def _span(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts: list[str] = []
    for i in layers:
        if parts and i == int(parts[-1].rpartition("-")[2]) + 1:
            parts[-1] = f"{parts[-1].partition('-')[0]}-{i}"
        else:
            parts.append(str(i))
    return ", ".join(parts) or "-"


def _added(entry, note: str = "") -> None:
    """Select the new run in the sidebar and say so after the rerun."""
    ss["k3lab_pending_run"] = str(entry.path)
    ss["k3lab_library_ok"] = f"Added **{entry.name}** to the runs library and selected it in the sidebar.{note}"
    st.rerun()


if ss.get("k3lab_library_ok"):
    st.success(ss.pop("k3lab_library_ok"))

tab_upload, tab_path, tab_preset = st.tabs(["Upload", "Open a folder on the server", "Fresh random model"])


def _show_plan(folder, info) -> None:
    """A checkpoint folder's size, parameters and where its weights would go (from headers and config)."""
    plan = memory_fit.placement_plan(folder, device, dtype)
    free = memory_fit.available_memory(device)
    c1, c2, c3, c4 = st.columns(4)
    c1.metric("Size on disk", format_bytes(info.size_bytes))
    c2.metric("Parameters", human_count(info.num_parameters))
    c3.metric(f"Memory in {dtype}", format_bytes(plan.total_bytes))
    c4.metric(f"Free on {device}", format_bytes(free) if free is not None else "unknown")
    st.caption(
        f"{md_escape(summary_text(info.summary))}; stored as "
        + ", ".join(f"{md_escape(k)} {format_bytes(v)}" for k, v in sorted(info.dtypes.items()))
        + (f"; {len(info.skipped)} tensors outside the text model are skipped" if info.skipped else "")
        + "; in memory: "
        + ", ".join(
            f"{d} {format_bytes(memory_fit.placement_plan(folder, device, d).total_bytes)}"
            for d in ("float32", "bfloat16")
        )
    )
    auto = memory_fit.placement_plan(folder, "auto", dtype)
    rows = []
    for name, p in ((f"on {device}", plan), ("spread (GPUs, then CPU, then disk)", auto)):
        for dev, nbytes in p.bytes_by_device.items():
            dev_free = memory_fit.available_memory(dev) if dev != "disk" else None
            rows.append(
                {
                    "placement": name,
                    "device": dev,
                    "memory": format_bytes(nbytes),
                    "free now": format_bytes(dev_free) if dev_free is not None else "",
                    "decoder layers": _span(p.layers_by_device.get(dev, [])),
                }
            )
    st.dataframe(rows, hide_index=True)
    ref = run_list.RunRef(folder.name, str(folder), "path")
    problem = memory_fit.fit_problem(ref, device, dtype)
    if problem:
        st.warning(problem)
    else:
        st.success(f"Fits: {format_bytes(plan.total_bytes)} of weights on {device} in {dtype}.")
    _show_rank_plan(info)


def _show_rank_plan(info) -> None:
    """Over several GPUs (pipeline parallel, ``k3lab inspect --plan``): how many, and which layers each holds."""
    gpu_gb = st.number_input("GPU memory (GB) for a multi-GPU plan", 1.0, 100000.0, 141.0, key="k3lab_open_gpu_gb")
    try:
        sizes = rank_plan.tensor_sizes(info.files, DTYPES[dtype])
        ranks = rank_plan.plan_for(sizes, info.files.config.num_hidden_layers, capacity=int(gpu_gb * 1e9 * 0.9))
    except ValueError as exc:
        st.caption(md_escape(exc))
        return
    st.caption(
        f"Resident over GPUs of {gpu_gb:g} GB (10% kept free) in {dtype}: {len(ranks.ranks)} GPU(s), one process "
        "each under torchrun (`k3lab inspect RUN --plan`)."
    )
    st.dataframe([r | {"bytes": format_bytes(r["bytes"])} for r in ranks.as_rows()], hide_index=True)


def _check_upload(entry, ref) -> None:
    """Load an upload once (every tensor: NaN/Inf, shapes; a trace folder's traces are read by the loader) and
    mark it checked; the library marks it unchecked if the server stops before this ends."""
    if entry.size_bytes <= VALIDATE_LOAD_BYTES and not memory_fit.fit_problem(ref, device, dtype):
        caching.load_run(ref, device, dtype)
    lib.mark_checked(entry.id)


for note in lib.recovered:
    st.info(md_escape(note))

# ----------------------------------------------------------------------------------------- upload
with tab_upload:
    limit = library_home.upload_limit_mb()
    mode = st.radio("What to upload", ["Files or a zip", "A whole folder"], horizontal=True, key="k3lab_upload_mode")
    with st.form("k3lab_upload", clear_on_submit=True):
        name = st.text_input("Name", placeholder="my-run", key="k3lab_upload_name")
        files = st.file_uploader(
            "Checkpoint folder" if mode == "A whole folder" else "Checkpoint files, or one .zip of the folder",
            accept_multiple_files="directory" if mode == "A whole folder" else True,
            key="k3lab_upload_files",
            type=UPLOAD_TYPES,
        )
        st.caption(
            f"Up to {limit:,} MB per file (`k3lab app --max-upload-mb N` changes it); the browser refuses a bigger "
            f"file before it reaches the app. A checkpoint larger than that: open its folder by path."
        )
        add = st.form_submit_button("Add run", type="primary", key="k3lab_upload_add")
    if add:
        entry = ref = None
        try:
            entry, skipped = lib.add_files(
                [(f.name, f) for f in files or []], name, mode == "A whole folder", checking=True
            )
            ref = run_list.ref_of(entry)
            _check_upload(entry, ref)
        except Exception as exc:  # noqa: BLE001 - an upload that fails any check is not kept, whatever failed
            if entry is not None:
                lib.delete(entry.id)
            if not isinstance(exc, USER_ERRORS):
                log.exception("checking an upload failed")
            shown = describe(exc) if ref is None else plain(run_messages.message(exc, ref))
            st.error(f"This checkpoint cannot be used: {shown}")
        else:
            _added(entry, f" Skipped: {md_escape(', '.join(skipped))}." if skipped else "")

# ----------------------------------------------------------------------------------------- by path
with tab_path:
    roots = library_home.allowed_roots()
    st.caption(
        "Reads the checkpoint where it is (nothing is copied): size, parameters and the memory it needs come from "
        "the file headers before anything is loaded. Folders that may be opened: "
        + ", ".join(f"`{r}`" for r in roots)
        + " (start the app with `k3lab app --root DIR` to allow another)."
    )
    typed = st.text_input("Checkpoint folder", key="k3lab_open_path", placeholder=str(roots[-1] / "my-checkpoint"))
    if st.button("Check the folder", key="k3lab_open_check"):
        ss["k3lab_open_checked"] = typed
    checked = ss.get("k3lab_open_checked")
    if checked and checked == typed:
        try:
            folder = confine_folder(checked, roots)
            info = describe_folder(folder)
        except PathRefused as exc:
            st.error(md_escape(exc))
        except LibraryError as exc:
            st.error(plain(exc))
        else:
            if info.files is None:  # a trace folder: no weights, nothing to place
                st.caption(f"A trace folder: {md_escape(summary_text(info.summary))}; {format_bytes(info.size_bytes)}.")
            else:
                _show_plan(folder, info)
            path_name = st.text_input("Name", value=folder.name, key="k3lab_open_name")
            if st.button("Add to the runs library", key="k3lab_open_add", type="primary"):
                try:
                    entry = lib.add_path(folder, path_name)
                except LibraryError as exc:
                    st.error(plain(exc))
                else:
                    ss.pop("k3lab_open_checked", None)
                    _added(entry)

# ----------------------------------------------------------------------------------------- preset
with tab_preset:

    @st.cache_data(show_spinner=False)
    def _preset_sizes() -> dict[str, int]:
        from k3core.modeling.model import K3ForCausalLM
        from k3core.modeling.presets import PRESETS

        return {p: K3ForCausalLM.from_config(p, device="meta").num_parameters() for p in PRESETS}

    sizes = _preset_sizes()
    can = {p: n for p, n in sizes.items() if n <= lib.max_preset_params}
    st.caption(
        "An untrained model with seeded random weights, saved into the library (float32). Presets above "
        f"{human_count(lib.max_preset_params)} parameters are not created here: "
        + ", ".join(f"{p} ({human_count(n)})" for p, n in sizes.items() if p not in can)
        + "."
    )
    c1, c2, c3 = st.columns([2, 1, 2])
    preset = c1.selectbox(
        "Preset", list(can), format_func=lambda p: f"{p} · {human_count(can[p])} params", key="k3lab_preset"
    )
    seed = c2.number_input("Seed", min_value=0, max_value=2**31 - 1, value=0, step=1, key="k3lab_preset_seed")
    preset_name = c3.text_input("Name", placeholder=f"{preset}-random", key="k3lab_preset_name")
    if st.button("Create", key="k3lab_preset_create", type="primary"):
        try:
            with st.spinner(f"Initialising and saving {preset}..."):
                entry = lib.add_preset(preset, preset_name, int(seed))
        except LibraryError as exc:
            st.error(plain(exc))
        else:
            _added(entry)

# ----------------------------------------------------------------------------------------- the list
st.divider()
st.markdown("#### Your runs library")
entries = lib.entries()
if not entries:
    st.caption("The library is empty. Runs you add here are kept until you delete them.")
for entry in entries:
    with st.container(border=True):
        c1, c2, c3, c4 = st.columns([6, 1, 1, 1])
        where = f" · {md_escape(entry.path)}" if entry.source == "path" else ""
        c1.markdown(
            f"**{entry.name}** · {SOURCE_NAMES[entry.source]} · {format_bytes(entry.size_bytes)} · added "
            f"{entry.added_at.replace('T', ' ')[:16]} UTC{where}"
        )
        c1.caption(f"{md_escape(summary_text(entry.summary))} · fingerprint {md_escape(entry.fingerprint[:12])}")
        refused = library_home.path_refusal(entry) if entry.available else None
        if entry.unchecked and entry.available:
            c1.warning("The check of this upload did not finish (the server stopped during it).")
            if c1.button("Check it now", key=f"k3lab_lib_check_{entry.id}"):
                try:
                    _check_upload(entry, run_list.ref_of(entry))
                except Exception as exc:  # noqa: BLE001 - the run stays, marked unchecked, with the reason shown
                    if not isinstance(exc, USER_ERRORS):
                        log.exception("checking a run again failed")
                    shown = plain(run_messages.message(exc, run_list.ref_of(entry)))
                    c1.error(f"This checkpoint cannot be used: {shown}")
                else:
                    st.rerun()
        if not entry.available:
            c1.warning("The files of this run are gone (a folder moved or a disk unmounted); delete the entry.")
        elif refused:
            c1.warning(f"Not offered in the run picker: {md_escape(refused)}")
        elif c2.button("Select", key=f"k3lab_lib_select_{entry.id}"):
            ss["k3lab_pending_run"] = str(entry.path)
            st.rerun()
        with c3.popover("Rename"):
            new_name = st.text_input("New name", value=entry.name, key=f"k3lab_lib_name_{entry.id}")
            if st.button("Save", key=f"k3lab_lib_rename_{entry.id}"):
                try:
                    lib.rename(entry.id, new_name)
                except LibraryError as exc:
                    st.error(plain(exc))
                else:
                    ss["k3lab_pending_run"] = str(entry.path)
                    st.rerun()
        with c4.popover("Delete"):
            st.markdown(
                f"Delete **{entry.name}**? "
                + ("Its files are removed." if entry.stored else "The folder itself is left where it is.")
            )
            if st.button("Delete", key=f"k3lab_lib_delete_{entry.id}", type="primary"):
                lib.delete(entry.id)
                ss["k3lab_library_ok"] = f"Deleted **{md_escape(entry.name)}** from the runs library." + (
                    " Its files are removed." if entry.stored else " The folder itself is left where it is."
                )
                st.rerun()
