"""One model shared by every session: its forward passes run together, work that installs hooks on it runs alone
(``model_use``). The app's cached runs hold one model per checkpoint (``app.render.caching``), so a session's
patching or attribution must not add hooks while another session's forward is running."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any


class _SharedExclusive:
    """Many forward passes at once, or one job that changes the model's hooks, never both."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0  # exclusive jobs waiting: new forwards queue behind them, so they are not starved

    @contextlib.contextmanager
    def hold(self, exclusive: bool) -> Iterator[None]:
        with self._cond:
            if exclusive:
                self._waiting += 1
                self._cond.wait_for(lambda: not self._exclusive and self._shared == 0)
                self._waiting -= 1
                self._exclusive = True
            else:
                self._cond.wait_for(lambda: not self._exclusive and self._waiting == 0)
                self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                if exclusive:
                    self._exclusive = False
                else:
                    self._shared -= 1
                self._cond.notify_all()


_GUARDS: weakref.WeakKeyDictionary[Any, _SharedExclusive] = weakref.WeakKeyDictionary()
_GUARDS_LOCK = threading.Lock()


def model_use(model: Any, exclusive: bool = False) -> contextlib.AbstractContextManager[None]:
    """Use a shared model: forward passes (exclusive=False) run together; hook-installing work runs alone."""
    with _GUARDS_LOCK:
        guard = _GUARDS.setdefault(model, _SharedExclusive())
    return guard.hold(exclusive)
