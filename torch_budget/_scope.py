"""Context managers entered once and ended once: region() and sleeping().

contextlib's generator context managers run their body when ended without being entered (a
region opened and closed again; a sleeping() released and restored every tag it names, their
contents lost under backup="none") and end a second time without a word. A scope made here
refuses both, and a second entry, with StateError and changes nothing."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from .errors import StateError

__all__ = ["once"]


class _Once(contextlib.AbstractContextManager, contextlib.ContextDecorator):
    def __init__(self, label: str, make: Callable[[], contextlib.AbstractContextManager]):
        self._label = label
        self._make = make
        self._scope = make()
        self._state = "new"  # new -> open -> ended; an __enter__ that raised ends it too

    def _recreate_cm(self):  # used as a decorator: a fresh scope per call
        return _Once(self._label, self._make)

    def __enter__(self):
        if self._state != "new":
            raise StateError(f"{self._label} {'is open' if self._state == 'open' else 'has ended'} already: a scope "
                             "is entered once (make a new one)")
        self._state = "ended"
        value = self._scope.__enter__()
        self._state = "open"
        return value

    def __exit__(self, *exc):
        if self._state != "open":
            raise StateError(f"{self._label} {'was never entered' if self._state == 'new' else 'has ended already'}"
                             ": a scope is ended once, after it was entered; nothing was changed")
        self._state = "ended"
        return self._scope.__exit__(*exc)


def once(label: Callable[..., str]):
    """Makes a generator function a context manager as contextlib.contextmanager does, entered
    once and ended once; `label(*args, **kwargs)` names the scope in its refusals."""
    def wrap(fn: Callable[..., Iterator[Any]]):
        manager = contextlib.contextmanager(fn)

        @functools.wraps(fn)
        def make(*args, **kwargs):
            return _Once(label(*args, **kwargs), lambda: manager(*args, **kwargs))
        return make
    return wrap
