"""The server's memory budget for long jobs (trace, experiment, patching, attribution): each job states its
estimated peak (``analysis.runs.job_memory``) and is admitted while the sum of the admitted jobs' estimates fits the
budget; otherwise it waits its turn (at most ``wait_s``, the page saying so) and is then refused with a message.
A job larger than the whole budget is refused at once. Browsing (cached figures, pages) takes no budget, so it
stays responsive while jobs run. One budget per server process (every session shares it).

The budget: ``k3lab app --job-memory SIZE`` (``K3LAB_JOB_MEMORY``, e.g. "6GB"), default half of the machine's
memory (``app.server.settings.job_memory_bytes``). No Streamlit here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from analysis.output.format import format_bytes
from app.server.settings import job_memory_bytes

DEFAULT_WAIT_S = 120.0


class JobRefused(RuntimeError):
    """A job that does not fit the server's job memory budget (now, or at all); the message says which."""


class JobBudget:
    """Admission of jobs by estimated peak memory against ``total_bytes``; thread safe."""

    def __init__(self, total_bytes: int, wait_s: float = DEFAULT_WAIT_S) -> None:
        self.total_bytes = int(total_bytes)
        self.wait_s = float(wait_s)
        self.admitted_bytes = 0
        self.peak_admitted_bytes = 0  # the most ever admitted at once (tests and the log read it)
        self.running: dict[int, tuple[str, int]] = {}
        self._cond = threading.Condition()
        self._next = 0

    @contextmanager
    def admit(self, nbytes: int, what: str, waiting: Callable[[str], None] | None = None) -> Iterator[None]:
        """Run the block once ``nbytes`` fit beside the jobs already admitted; JobRefused when it never fits
        (over the whole budget) or did not within ``wait_s``. ``waiting(message)`` is told once when it queues."""
        nbytes = max(int(nbytes), 0)
        if nbytes > self.total_bytes:
            raise JobRefused(
                f"{what} needs about {format_bytes(nbytes)} of memory, more than this server's budget for jobs "
                f"({format_bytes(self.total_bytes)}; `k3lab app --job-memory SIZE` sets it): use fewer tokens"
            )
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            told = False
            while self.admitted_bytes + nbytes > self.total_bytes:
                if not told and waiting is not None:
                    waiting(self._busy(what, nbytes))
                    told = True
                left = deadline - time.monotonic()
                if left <= 0:
                    raise JobRefused(self._busy(what, nbytes) + f"; it waited {self.wait_s:.0f} s: try again later")
                self._cond.wait(timeout=left)
            self._next += 1
            ticket = self._next
            self.admitted_bytes += nbytes
            self.peak_admitted_bytes = max(self.peak_admitted_bytes, self.admitted_bytes)
            self.running[ticket] = (what, nbytes)
        try:
            yield
        finally:
            with self._cond:
                self.admitted_bytes -= nbytes
                self.running.pop(ticket, None)
                self._cond.notify_all()

    def _busy(self, what: str, nbytes: int) -> str:
        return (
            f"{what} (about {format_bytes(nbytes)}) waits for memory: {len(self.running)} job(s) running use "
            f"{format_bytes(self.admitted_bytes)} of this server's {format_bytes(self.total_bytes)} for jobs"
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
