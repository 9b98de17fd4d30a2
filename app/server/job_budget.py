"""The server's memory budget for long jobs (trace, experiment, patching, attribution) and what they leave behind.

The budget (``k3lab app --job-memory SIZE``, ``K3LAB_JOB_MEMORY``, e.g. "6GB"; default half of the machine's memory,
``app.server.settings.job_memory_bytes``) is split: ``KEPT_SHARE`` of it keeps finished results for the next visit
(``app.server.kept_results``: traces, contexts and figures, an LRU by measured bytes), the rest runs jobs. Each job
states its estimated peak (``analysis.runs.job_memory``) and is admitted while the sum of the admitted jobs'
estimates fits the running share; otherwise it waits its turn (at most ``wait_s``, the page saying so) and is then
refused with a message. A job larger than the whole running share is refused at once. When a job ends, the memory
it freed is given back to the system (``app.server.process_memory``). So the server's memory for jobs and their
results stays within the budget; the loaded models are outside it (each is checked against the device's free memory
before it loads, ``app.library.memory_fit``, and a model too large runs from its files within the sidebar's memory
budget, ``--max-memory``). One budget per server process (every session shares it). No Streamlit here.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from analysis.output.format import format_bytes
from app.server.kept_results import KeptResults
from app.server.process_memory import release_freed_memory
from app.server.settings import job_memory_bytes

DEFAULT_WAIT_S = 120.0
KEPT_SHARE = 0.25  # of the budget, for finished results; the rest for running jobs


class JobRefused(RuntimeError):
    """A job that does not fit the server's job memory budget (now, or at all); the message says which."""


class AdmittedJob:
    """What ``JobBudget.admit`` yields: ``hold_until_freed(result)`` keeps the job's bytes admitted after the block
    until ``result`` is freed (a result too large for the kept share, used by its sessions meanwhile: counted among
    the running jobs, not outside the budget)."""

    def __init__(self) -> None:
        self.holder: Any = None

    def hold_until_freed(self, result: Any) -> None:
        self.holder = result


class JobBudget:
    """Admission of jobs by estimated peak memory against ``jobs_bytes``, the running share of ``total_bytes``; the
    rest (``kept``) keeps finished results. Thread safe."""

    def __init__(self, total_bytes: int, wait_s: float = DEFAULT_WAIT_S, kept_share: float = KEPT_SHARE) -> None:
        self.total_bytes = int(total_bytes)
        self.kept = KeptResults(int(self.total_bytes * kept_share))
        self.jobs_bytes = self.total_bytes - self.kept.capacity
        self.wait_s = float(wait_s)
        self.admitted_bytes = 0
        self.peak_admitted_bytes = 0  # the most ever admitted at once (tests and the log read it)
        self.running: dict[int, tuple[str, int]] = {}
        self.queued = 0  # jobs waiting for memory (their pages are idle: background work may go on meanwhile)
        self._cond = threading.Condition()
        self._next = 0

    @contextmanager
    def admit(
        self, nbytes: int, what: str, waiting: Callable[[str], None] | None = None, hint: str = "use fewer tokens"
    ) -> Iterator[AdmittedJob]:
        """Run the block once ``nbytes`` fit beside the jobs already admitted; JobRefused when it never fits
        (over the whole running share; the message ends with ``hint``, what the user can do) or did not within
        ``wait_s``. ``waiting(message)`` is told once when it queues. The memory the block freed is given back to the
        system when it ends; its bytes stay admitted past the block while a result it names with
        ``AdmittedJob.hold_until_freed`` lives."""
        nbytes = max(int(nbytes), 0)
        if nbytes > self.jobs_bytes:
            raise JobRefused(
                f"{what} needs about {format_bytes(nbytes)} of memory, more than this server runs jobs in "
                f"({format_bytes(self.jobs_bytes)} of its {format_bytes(self.total_bytes)} job memory, the rest keeps "
                f"finished results; `k3lab app --job-memory SIZE` sets it): {hint}"
            )
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            told = False
            try:
                while self.admitted_bytes + nbytes > self.jobs_bytes:
                    if not told:
                        self.queued += 1
                        told = True
                        if waiting is not None:
                            waiting(self._busy(what, nbytes))
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise JobRefused(self._busy(what, nbytes) + f"; it waited {self.wait_s:.0f} s: try again later")
                    self._cond.wait(timeout=left)
            finally:
                self.queued -= told
            self._next += 1
            ticket = self._next
            self.admitted_bytes += nbytes
            self.peak_admitted_bytes = max(self.peak_admitted_bytes, self.admitted_bytes)
            self.running[ticket] = (what, nbytes)
        job = AdmittedJob()
        try:
            yield job
        finally:
            release_freed_memory()  # the job's working memory, freed by now (its result is kept or used)
            if job.holder is None:
                self._end(ticket, nbytes)
            else:  # a result too large to keep: its bytes stay admitted while it is used
                weakref.finalize(job.holder, self._end, ticket, nbytes)
                job.holder = None

    def _end(self, ticket: int, nbytes: int) -> None:
        with self._cond:
            self.admitted_bytes -= nbytes
            self.running.pop(ticket, None)
            self._cond.notify_all()

    def _busy(self, what: str, nbytes: int) -> str:
        return (
            f"{what} (about {format_bytes(nbytes)}) waits for memory: {len(self.running)} job(s) running use "
            f"{format_bytes(self.admitted_bytes)} of the {format_bytes(self.jobs_bytes)} this server runs jobs in"
        )


_BUDGET: JobBudget | None = None
_BUDGET_LOCK = threading.Lock()


def budget() -> JobBudget:
    """The budget of this server process (from the environment at first use)."""
    global _BUDGET
    with _BUDGET_LOCK:
        if _BUDGET is None:
            _BUDGET = JobBudget(job_memory_bytes())
        return _BUDGET


def reset(total_bytes: int | None = None, wait_s: float = DEFAULT_WAIT_S) -> JobBudget:
    """A fresh budget (from the environment, or ``total_bytes``): a server start, or a test."""
    global _BUDGET
    with _BUDGET_LOCK:
        _BUDGET = JobBudget(job_memory_bytes() if total_bytes is None else total_bytes, wait_s)
        return _BUDGET
