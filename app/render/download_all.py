"""Download all: the ``k3lab report`` folder of the shown run(s) and text, as one zip.

The app does not write a report of its own: it runs ``analysis.output.report.write_report`` (what ``k3lab report``
runs) with the runs, the sample or text, max tokens, static images on or off and the model views skipped or
not, into a temporary folder, and zips that folder, so the zip holds exactly what ``k3lab report`` writes:
report.html, headline.json and figures/ (CSV, JSON, PNG, SVG per figure).
"""

from __future__ import annotations

import io
import tempfile
import time
import zipfile
from pathlib import Path

import streamlit as st

from analysis.output.report import select_views, write_report
from analysis.views.catalogue import all_views
from app.library.run_list import RunRef
from app.render.cards import slug
from app.state.inputs import SAMPLE_OF_SOURCE, InputError, TextChoice
from k3core.interp.trace_folder import is_trace_dir
from k3core.loading.tensor_info import CheckpointError


def report_options(choice: TextChoice, out: Path) -> dict:
    """``analysis.output.report.write_report``'s input options for this text (a user text goes to
    ``out``/../input.txt)."""
    if choice.source in SAMPLE_OF_SOURCE:
        return {"sample": SAMPLE_OF_SOURCE[choice.source], "max_tokens": choice.max_tokens}
    if not choice.text:
        raise InputError("there is no text to report on: paste or upload some, or pick a built-in sample")
    text_file = out.parent / "input.txt"
    text_file.write_text(choice.text, encoding="utf-8")
    return {"text_file": text_file, "max_tokens": choice.max_tokens}


def zip_folder(folder: Path, root_name: str) -> bytes:
    """Every file under ``folder`` in a zip, under ``root_name``/ (sorted, so the order is stable)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for file in sorted(p for p in folder.rglob("*") if p.is_file()):
            zf.write(file, f"{root_name}/{file.relative_to(folder).as_posix()}")
    return buf.getvalue()


def report_steps(refs: list[RunRef], skip_model_views: bool) -> int:
    """The steps ``write_report`` counts for these runs (as ``k3lab report``'s bar): loads, traces, views, writes."""
    return 2 * len(refs) + len(select_views(all_views(), None, skip_model_views)) + 3


class StepCount:
    """``write_report``'s progress (``update(n)``) on a Streamlit progress bar: "step 12 of 41"."""

    def __init__(self, bar, total: int) -> None:
        self.bar, self.total, self.done = bar, max(total, 1), 0

    def update(self, n: int = 1) -> None:
        self.done = min(self.done + n, self.total)
        self.bar.progress(self.done / self.total, text=f"step {self.done} of {self.total}")


def report_zip(
    refs: list[RunRef],
    choice: TextChoice,
    static: bool = True,
    skip_model_views: bool = False,
    progress: StepCount | None = None,
) -> bytes:
    """``k3lab report`` of one run (or two, compared) on this text, zipped; ``progress`` counts its steps. Raises
    InputError when it cannot run."""
    with tempfile.TemporaryDirectory(prefix="k3lab-report-") as tmp:
        out = Path(tmp) / "report"
        # a trace folder reports on the recorded text picked in the sidebar (it has no model to read another)
        recorded = {"max_tokens": choice.max_tokens, "text_index": choice.recorded or 0}
        options = recorded if is_trace_dir(refs[0].path) else report_options(choice, out)
        try:
            write_report(
                [r.path for r in refs],
                out,
                static=static,
                skip_model_views=skip_model_views,
                progress=progress,
                **options,
            )
        except (CheckpointError, ValueError, OSError) as exc:
            raise InputError(f"the report could not be written: {exc}") from exc
        return zip_folder(out, "report")


@st.fragment
def download_all(refs: list[RunRef], choice: TextChoice, key: str = "k3lab_all") -> None:
    """Options, a button that writes the report (a status line and a bar counting its steps), then the zip's download
    button."""
    ss = st.session_state
    c1, c2 = st.columns(2)
    static = c1.checkbox(
        "PNG and SVG images", value=True, key=f"{key}_static", help="As `k3lab report` (off: `--no-static`)."
    )
    skip = c2.checkbox(
        "Skip the importance views",
        key=f"{key}_skip",
        help="They run the model 2L + 2 more times (`--skip-model-views`).",
    )
    name = "_vs_".join(slug(r.label) for r in refs) + f"_{slug(choice.short)}_report.zip"
    signature = (tuple(r.path for r in refs), choice.key(), static, skip)
    if st.button("Prepare the report zip", key=f"{key}_go", help="Writes what `k3lab report` writes, then zips it."):
        with st.status("Writing the report: every view, its data and the headline numbers...") as status:
            start = time.perf_counter()
            steps = StepCount(st.progress(0.0, text="starting"), report_steps(refs, skip))
            try:
                data = report_zip(refs, choice, static, skip, steps)
            except InputError as exc:
                status.update(label=f"No report: {exc}", state="error")
                return
            status.update(label=f"Report written in {time.perf_counter() - start:.0f} s", state="complete")
        ss[f"{key}_zip"] = (signature, name, data)
    ready = ss.get(f"{key}_zip")
    if ready and ready[0] == signature:
        st.download_button(
            f"Download all ({len(ready[2]) / 1e6:.1f} MB zip)",
            data=ready[2],
            file_name=ready[1],
            mime="application/zip",
            key=f"{key}_download",
            type="primary",
        )
