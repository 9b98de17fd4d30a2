"""The server process's freed memory given back to the system, so its resident size follows what it holds.

A finished job frees its working memory, but glibc's malloc keeps freed memory in its heaps (one heap per thread that
allocated: every session's script thread has its own), so the process's resident size stays near the highest it
reached in each of them. Two causes, two remedies:

- the free top of a thread's heap is given back on ``free()`` only above the trim threshold, which glibc raises to
  twice the largest freed mmapped block (up to 64 MiB: a whole thread heap), and ``malloc_trim`` does not shrink a
  thread heap's top (glibc 2.36: a trim after the sessions below gave back 0-13 MB of the excess):
  ``limit_heap_retention`` fixes the threshold at ``TRIM_THRESHOLD`` (and the mmap threshold at glibc's own ceiling,
  ``MMAP_THRESHOLD``, which fixing the other would otherwise pin at 128 KiB), and allows one heap per core instead of
  glibc's eight (each may keep up to the threshold; a server after the sessions below had 12). Measured on a real
  server with a 335 MiB budget after six sessions, two of them tracing 2,048 tokens (one trace kept, 70 MB): +114 and
  +133 MiB resident once idle without it, +78 to +79 MiB with it (``tests/app/server/test_job_budget.py``);
- free blocks inside a heap go back with ``malloc_trim(0)`` (``release_freed_memory``; 11 ms on the k3-full
  sample): when a job ends (``app.server.job_budget``), and shortly after a result is made (the temporaries of its
  build) or a result the server no longer keeps is freed (``release_soon``, ``release_when_freed``: a session or a
  background build may hold it after it was dropped).

Giving every block of 128 KiB or more its own mapping instead (``MALLOC_MMAP_THRESHOLD_=131072``) doubled a
1,536-token trace's time (0.38 -> 0.75 s); these settings left it within the machine's noise (the fastest of five
traces in five alternating runs: 0.32-0.41 s with them, 0.33-0.44 s without). ``app.server.serve`` (what
``k3lab app`` runs) makes them. No-ops where the C library has neither call (macOS, musl). No Streamlit here.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters (malloc.h)
TRIM_THRESHOLD = 4 * 1024**2  # a heap's free top above this goes back to the system on free()
MMAP_THRESHOLD = 32 * 1024**2  # blocks this large get their own mapping (glibc's ceiling for its dynamic threshold)
_TRIM: Callable[[int], int] | None = None
_LOADED = False
_LOCK = threading.RLock()  # re-entrant: a finalizer may run release_soon in a thread that holds it
_FREED = threading.Event()  # set when memory was freed: trim once the frees pause
_TRIMMER: threading.Thread | None = None
TRIM_QUIET_S = 0.2
TRIM_DELAY_MAX_S = 2.0


def _malloc_trim() -> Callable[[int], int] | None:
    global _TRIM, _LOADED
    with _LOCK:
        if not _LOADED:
            _LOADED = True
            try:
                _TRIM = ctypes.CDLL(None).malloc_trim
            except (OSError, AttributeError):
                _TRIM = None
        return _TRIM


def limit_heap_retention() -> bool:
    """Fix glibc's trim and mmap thresholds (``TRIM_THRESHOLD``, ``MMAP_THRESHOLD``) and its heaps to one per core
    (glibc's default: eight per core, each keeping up to the threshold of free top) for this process, before its
    sessions start; False where the C library has no ``mallopt``."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    heaps = os.cpu_count() or 1
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_ARENA_MAX, heaps))
    return all([bool(mallopt(param, value)) for param, value in settings])  # a list: every setting is made


def release_freed_memory() -> bool:
    """Give the heap pages that nothing uses back to the system (glibc ``malloc_trim(0)``); False where it cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def _trim_when_quiet() -> None:
    while True:
        _FREED.wait()
        start = time.monotonic()
        _FREED.clear()
        while time.monotonic() - start < TRIM_DELAY_MAX_S and _FREED.wait(TRIM_QUIET_S):  # more coming: wait
            _FREED.clear()
        release_freed_memory()


def release_soon() -> None:
    """Give the freed memory back shortly, once ``TRIM_QUIET_S`` pass without another call (at most
    ``TRIM_DELAY_MAX_S`` later): after work whose temporaries are freed by now (a figure built), one trim per burst
    of it, in a background thread."""
    global _TRIMMER
    if _malloc_trim() is None:
        return
    with _LOCK:
        if _TRIMMER is None:
            _TRIMMER = threading.Thread(target=_trim_when_quiet, name="k3lab-trim", daemon=True)
            _TRIMMER.start()
    _FREED.set()


def release_when_freed(value: Any) -> None:
    """``release_soon`` once ``value`` is freed (when its last holder drops it; its finalizer runs just before its
    memory is released, the trim after). Values that take no weak reference (a tuple, a list) are watched through
    their items."""
    for item in value if isinstance(value, (tuple, list)) else (value,):
        try:
            weakref.finalize(item, release_soon)
        except TypeError:  # no weak references (None, a str, a tuple of tuples): nothing large to watch
            continue
