"""Survey jobs of the app: a corpus survey (``analysis.survey.engine.run_survey``) in a background thread, one per
survey folder, with its progress and a Stop flag the Survey page reads and sets. The folder is saved every few batches,
so the page draws results as they fill in and a stopped survey continues when started again."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from analysis.survey import engine as sv
from analysis.survey.folder import CARD_NAME, is_survey_dir
from analysis.survey.plan import SurveyPlan
from app.server.settings import home_dir


@dataclass
class SurveyJob:
    folder: Path
    total: int = 0
    done: int = 0
    started: float = field(default_factory=time.monotonic)
    error: str | None = None
    finished: bool = False
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def eta_seconds(self) -> float | None:
        if not self.done or not self.total:
            return None
        return (time.monotonic() - self.started) / self.done * (self.total - self.done)


_JOBS: dict[str, SurveyJob] = {}
_LOCK = threading.Lock()


def surveys_dir() -> Path:
    """Where the app keeps survey folders: <k3lab home>/surveys."""
    return home_dir() / "surveys"


def survey_folders() -> list[Path]:
    """The survey folders the app has written, newest first."""
    root = surveys_dir()
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if is_survey_dir(p)]
    return sorted(found, key=lambda p: (p / CARD_NAME).stat().st_mtime, reverse=True)


def job_of(folder: Path) -> SurveyJob | None:
    with _LOCK:
        return _JOBS.get(str(folder))


def start(run: Any, ids: Any, plan: SurveyPlan, folder: Path, save_every: int = 4) -> SurveyJob:
    """Start (or continue) the survey of ``folder`` in a thread; a job already running there is returned as is."""
    with _LOCK:
        job = _JOBS.get(str(folder))
        if job is not None and job.running:
            return job
        job = SurveyJob(folder=folder, total=plan.batches)
        _JOBS[str(folder)] = job

    def progress(done: int, total: int) -> bool:
        job.done, job.total = done, total
        return not job.stop.is_set()

    def work() -> None:
        try:
            sv.run_survey(run, ids, plan, folder, progress=progress, save_every=save_every)
        except sv.SurveyStopped:
            pass
        except Exception as exc:  # noqa: BLE001 - shown on the page; the app keeps running
            job.error = f"{type(exc).__name__}: {exc}"
        finally:
            job.finished = True

    job.thread = threading.Thread(target=work, name=f"k3lab-survey-{folder.name}", daemon=True)
    job.thread.start()
    return job
