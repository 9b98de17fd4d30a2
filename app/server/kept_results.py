"""What finished jobs leave behind, kept for the next visit: an LRU of results bounded by their bytes.

The server's job memory (``app.server.job_budget``, ``--job-memory``) is split: ``job_budget.KEPT_SHARE`` of it keeps
finished results (the traced analysis contexts, built figures and comparisons of ``app.render.caching``), the rest
runs jobs. A result is measured when it is kept (``analysis.runs.job_memory``: ``context_bytes``, ``held_bytes``),
and measured again on each use where it can grow (a context keeps what is computed on it later). While the kept
bytes pass the capacity, the least recently used results are dropped, oldest first; a result larger than the whole
capacity is used and not kept (its next visit computes it again). Sessions asking for a result being computed wait
for that computation and share its value, as with ``st.cache_resource``. No Streamlit here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from app.server.process_memory import release_soon, release_when_freed


@dataclass
class _Kept:
    value: Any
    nbytes: int
    measure: Callable[[Any], int]
    grows: bool
    holder: Callable[[Any], Any]


@dataclass
class _Pending:
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    made: bool = False


class KeptResults:
    """An LRU of results under ``capacity`` bytes; thread safe. ``kept_bytes`` is the sum of the kept results'
    measured bytes; ``peak_kept_bytes`` the most it has been; ``evicted`` and ``not_kept`` count the results dropped
    to make room and the ones too large to keep (tests read them)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(int(capacity), 0)
        self.kept_bytes = 0
        self.peak_kept_bytes = 0
        self.evicted = 0
        self.not_kept = 0
        self._entries: OrderedDict[Hashable, _Kept] = OrderedDict()
        self._pending: dict[Hashable, _Pending] = {}
        self._lock = threading.Lock()

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def get(
        self,
        key: Hashable,
        make: Callable[[], Any],
        measure: Callable[[Any], int],
        grows: bool = False,
        holder: Callable[[Any], Any] = lambda value: value,
    ) -> Any:
        """The kept result of ``key``, else ``make()``'s, kept when ``measure(result)`` bytes fit the capacity.
        ``grows``: the result may hold more later (measured again on each use). ``holder(result)``: the object whose
        freeing frees the result's memory (the result itself; for a context, its trace, shared by its copies). An
        error of ``make`` is raised and nothing is kept; a session that waited for it computes the result itself."""
        while True:
            with self._lock:
                kept = self._entries.get(key)
                if kept is not None:
                    self._entries.move_to_end(key)
                    break
                pending = self._pending.get(key)
                mine = pending is None
                if mine:
                    pending = self._pending[key] = _Pending()
            if mine:
                return self._make(key, pending, make, measure, grows, holder)
            pending.done.wait()
            if pending.made:
                return pending.value
        if kept.grows:
            self._remeasure(key, kept)
        return kept.value

    def _make(self, key: Hashable, pending: _Pending, make: Callable[[], Any], measure, grows: bool, holder) -> Any:
        try:
            value = make()
            nbytes = int(measure(value))
        except BaseException:
            with self._lock:
                del self._pending[key]
            pending.done.set()  # its waiters (made False) compute it themselves
            raise
        pending.value, pending.made = value, True
        dropped: list[Any] = []
        with self._lock:
            del self._pending[key]
            if nbytes > self.capacity:
                self.not_kept += 1
                dropped = [holder(value)]  # used by its callers, freed with them
            else:
                self._entries[key] = _Kept(value, nbytes, measure, grows, holder)
                self.kept_bytes += nbytes
                dropped = self._evict()
        pending.done.set()
        self._released(dropped)
        release_soon()  # what making it freed (a figure's temporaries, a job's by now)
        return value

    def _remeasure(self, key: Hashable, kept: _Kept) -> None:
        nbytes = int(kept.measure(kept.value))
        with self._lock:
            if self._entries.get(key) is not kept or nbytes == kept.nbytes:
                return
            self.kept_bytes += nbytes - kept.nbytes
            kept.nbytes = nbytes
            dropped = []
            if nbytes > self.capacity:  # grew past the whole capacity: used by whoever holds it, no longer kept
                del self._entries[key]
                self.kept_bytes -= nbytes
                self.not_kept += 1
                dropped.append(kept.holder(kept.value))
            dropped += self._evict()
        self._released(dropped)

    def _evict(self) -> list[Any]:
        """Drop the least recently used results until the kept bytes fit (under the lock); their holders."""
        dropped = []
        while self.kept_bytes > self.capacity and self._entries:
            _, old = self._entries.popitem(last=False)
            self.kept_bytes -= old.nbytes
            self.evicted += 1
            dropped.append(old.holder(old.value))
        self.peak_kept_bytes = max(self.peak_kept_bytes, self.kept_bytes)
        return dropped

    @staticmethod
    def _released(dropped: list[Any]) -> None:
        """Results no longer kept (their holders): their memory goes back to the system once they are freed (here,
        or when a session or background build that still uses one drops it)."""
        for value in dropped:
            release_when_freed(value)
        dropped.clear()

    def clear(self) -> None:
        """Drop every kept result."""
        with self._lock:
            dropped = [kept.holder(kept.value) for kept in self._entries.values()]
            self._entries.clear()
            self.kept_bytes = 0
        self._released(dropped)
