"""Context managers entered once and ended once: region(), sleeping(), the adapters' scopes.

contextlib's generator context managers run their body when ended without being entered (a
region opened and closed again; a sleeping() released and restored every tag it names, their
contents lost under backup="none") and end a second time without a word. A scope made here
refuses both, and a second entry, with StateError and changes nothing.

region() runs per forward: a scope keeps its arguments and words its label only for a refusal."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from .errors import StateError

__all__ = ["once"]

_NEW, _OPEN, _ENDED = 0, 1, 2  # an __enter__ that raised ends the scope too


class _Once(contextlib.AbstractContextManager, contextlib.ContextDecorator):
    __slots__ = ("_label", "_manager", "_args", "_kwargs", "_scope", "_state")

    def __init__(self, label: Callable[..., str], manager: Callable[..., contextlib.AbstractContextManager],
                 args: tuple, kwargs: dict):
        self._label = label
        self._manager = manager
        self._args = args
        self._kwargs = kwargs
        self._scope = manager(*args, **kwargs)
        self._state = _NEW

    def _recreate_cm(self):  # used as a decorator: a fresh scope per call
        return _Once(self._label, self._manager, self._args, self._kwargs)

    def _refuse(self, what: str) -> StateError:
        return StateError(f"{self._label(*self._args, **self._kwargs)} {what}")

    def __enter__(self):
        if self._state != _NEW:
            raise self._refuse(f"{'is open' if self._state == _OPEN else 'has ended'} already: a scope is entered "
                               "once (make a new one)")
        self._state = _ENDED
        value = self._scope.__enter__()
        self._state = _OPEN
        return value

    def __exit__(self, typ, value, traceback):
        if self._state != _OPEN:
            raise self._refuse(f"{'was never entered' if self._state == _NEW else 'has ended already'}: a scope "
                               "is ended once, after it was entered; nothing was changed")
        self._state = _ENDED
        return self._scope.__exit__(typ, value, traceback)


def once(label: Callable[..., str]):
    """Makes a generator function a context manager as contextlib.contextmanager does, entered
    once and ended once; `label(*args, **kwargs)` names the scope in its refusals."""
    def wrap(fn: Callable[..., Iterator[Any]]):
        manager = contextlib.contextmanager(fn)

        @functools.wraps(fn)
        def make(*args, **kwargs):
            return _Once(label, manager, args, kwargs)
        return make
    return wrap
