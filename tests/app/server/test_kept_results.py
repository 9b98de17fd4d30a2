"""app.server.kept_results: what finished jobs leave behind, an LRU bounded by measured bytes (issue 28), and
app.server.process_memory, which gives what it drops back to the system."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

from app.server import kept_results, process_memory
from app.server.kept_results import KeptResults


class Result:
    """A result of a given size (weak references work, as on an AnalysisContext's trace)."""

    def __init__(self, name: str, nbytes: int) -> None:
        self.name, self.nbytes = name, nbytes


def size(result: Result) -> int:
    return result.nbytes


def test_results_are_kept_by_bytes_and_the_least_recently_used_go_first():
    kept, made = KeptResults(100), []

    def get(name: str, nbytes: int) -> Result:
        return kept.get(name, lambda: made.append(name) or Result(name, nbytes), size)

    a, b = get("a", 40), get("b", 40)
    assert get("a", 40) is a and made == ["a", "b"] and kept.kept_bytes == 80  # a is used again: b is the oldest
    get("c", 40)  # 120 > 100: b goes
    assert "b" not in kept and "a" in kept and "c" in kept and kept.kept_bytes == 80 and kept.evicted == 1
    assert get("b", 40) is not b and made == ["a", "b", "c", "b"]  # made again
    assert kept.peak_kept_bytes <= kept.capacity


def test_a_result_larger_than_the_capacity_is_used_and_not_kept():
    kept, made = KeptResults(100), []
    small = kept.get("small", lambda: Result("small", 10), size)
    for _ in range(2):
        big = kept.get("big", lambda: made.append(1) or Result("big", 101), size)
        assert big.nbytes == 101
    assert len(made) == 2 and "big" not in kept and kept.not_kept == 2
    assert kept.get("small", lambda: Result("other", 10), size) is small and kept.kept_bytes == 10  # nothing evicted


def test_a_result_that_grows_is_measured_again_when_used():
    kept = KeptResults(100)
    first = kept.get("first", lambda: Result("first", 30), size, grows=True)
    kept.get("second", lambda: Result("second", 30), size)
    first.nbytes = 60  # e.g. a context that now holds an experiment's results
    assert kept.get("first", lambda: Result("x", 0), size, grows=True) is first
    assert kept.kept_bytes == 90
    first.nbytes = 80
    kept.get("first", lambda: Result("x", 0), size, grows=True)  # 110: the older one (second) goes
    assert "second" not in kept and kept.kept_bytes == 80
    first.nbytes = 200
    assert kept.get("first", lambda: Result("x", 0), size, grows=True) is first  # used, no longer kept
    assert "first" not in kept and kept.kept_bytes == 0 and kept.not_kept == 1


def test_sessions_asking_at_once_share_one_computation():
    kept, calls = KeptResults(100), []
    go = threading.Barrier(4)

    def make() -> Result:
        calls.append(1)
        return Result("shared", 50)

    def ask() -> None:
        go.wait(10)
        got.append(kept.get("k", make, size))

    got: list[Result] = []
    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(got) == 4 and len({id(r) for r in got}) == 1 and calls == [1]


def test_a_result_too_large_to_keep_is_handed_to_the_sessions_that_waited_for_it(monkeypatch):
    waiting = threading.Event()

    class Told(threading.Event):
        def wait(self, timeout=None):
            waiting.set()  # a second session waits for the computation in progress
            return super().wait(timeout)

    pending = kept_results._Pending
    monkeypatch.setattr(kept_results, "_Pending", lambda: pending(done=Told()))
    kept, calls, got = KeptResults(100), [], []

    def make() -> Result:
        calls.append(1)
        second.start()
        assert waiting.wait(10)
        return Result("large", 200)

    second = threading.Thread(target=lambda: got.append(kept.get("k", make, size)))
    got.append(kept.get("k", make, size))
    second.join(10)
    assert calls == [1] and len(got) == 2 and got[0] is got[1] and "k" not in kept


def test_a_failed_computation_is_not_kept_and_is_tried_again():
    kept, tries = KeptResults(100), []

    def make() -> Result:
        tries.append(1)
        if len(tries) == 1:
            raise ValueError("bad input")
        return Result("ok", 10)

    with pytest.raises(ValueError, match="bad input"):
        kept.get("k", make, size)
    assert "k" not in kept and not kept._pending
    assert kept.get("k", make, size).name == "ok" and len(tries) == 2


def test_a_dropped_result_is_freed_once_its_last_holder_lets_it_go(monkeypatch):
    """The store keeps no reference to what it drops, and the memory is given back when the result is freed (here, or
    by a session that still held it)."""
    trims = []
    monkeypatch.setattr(process_memory, "release_soon", lambda: trims.append(1))
    kept = KeptResults(100)
    held = kept.get("a", lambda: Result("a", 60), size)  # a session still draws from it
    alive = weakref.ref(held)
    kept.get("b", lambda: Result("b", 60), size)  # evicts a
    trims.clear()
    assert "a" not in kept and alive() is held
    del held
    gc.collect()
    assert alive() is None and trims  # freed, and its finalizer asked for the trim


def test_release_soon_trims_once_the_frees_pause(monkeypatch):
    done = threading.Event()
    monkeypatch.setattr(process_memory, "release_freed_memory", lambda: done.set() or True)
    if process_memory._malloc_trim() is None:
        pytest.skip("no malloc_trim in this C library")
    for _ in range(5):
        process_memory.release_soon()
    assert done.wait(process_memory.TRIM_DELAY_MAX_S + 5)
