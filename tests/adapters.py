"""The one switch between the learner's code and the reference answers.

Exercise tests never import ``exercises`` or ``solutions`` directly; they ask this
module for a function by chapter and name. ``MINILLM_IMPL`` picks the package:

    MINILLM_IMPL=exercises   (default) grade your own code in exercises/
    MINILLM_IMPL=solutions   check the tests against the reference answers

A stub that still raises ``NotImplementedError`` fails its tests with one short line,
"not implemented yet: exercises/ch00_the_model.py::rms_norm", instead of a traceback.
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any, Callable

import pytest

ENV_VAR = "MINILLM_IMPL"
IMPLS = ("exercises", "solutions")
NOT_IMPLEMENTED = "not implemented yet"  # the grader looks for this prefix


def impl() -> str:
    """The package under test, read from the environment at every call."""
    name = os.environ.get(ENV_VAR, "exercises").strip() or "exercises"
    if name not in IMPLS:
        raise ValueError(f"{ENV_VAR} must be one of {', '.join(IMPLS)}, got {name!r}")
    return name


def load(chapter: str) -> ModuleType:
    """The module ``exercises.<chapter>`` or ``solutions.<chapter>``, e.g. chapter="ch00_the_model"."""
    return importlib.import_module(f"{impl()}.{chapter}")


def function(chapter: str, name: str) -> Callable[..., Any]:
    """A stand-in for ``<impl>.<chapter>.<name>`` that imports it only when called.

    Importing late means a syntax error in one exercise file fails that chapter's tests
    with a readable message rather than breaking test collection, and a stub that
    raises ``NotImplementedError`` fails with "not implemented yet: <file>::<name>".
    """

    def call(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        where = f"{impl()}/{chapter}.py"
        # pytest.fail is called outside the except blocks so the report is one line,
        # not the learner's exception chained to ours.
        problem = None
        try:
            module = load(chapter)
        except ImportError:
            raise  # a missing package or chapter is a setup problem: show it in full
        except Exception as e:  # a syntax error or a crash at import time in the learner's file
            problem = f"could not import {where}: {type(e).__name__}: {e}"
        if problem is None:
            fn = getattr(module, name, None)
            if not callable(fn):
                problem = f"{where} has no function {name}()"
        if problem is None:
            try:
                return fn(*args, **kwargs)
            except NotImplementedError:
                problem = f"{NOT_IMPLEMENTED}: {where}::{name}"
        pytest.fail(problem, pytrace=False)

    call.__name__ = call.__qualname__ = name
    return call


def _short(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 5] + " ...)"


def first_difference(got: Any, want: Any) -> str:
    """Where ``got`` first differs from ``want``: an index (nested for lists of lists; a tuple
    is one value, e.g. a row (request id, tokens)), or the lengths."""
    if isinstance(got, list) and isinstance(want, list):
        for i, (g, w) in enumerate(zip(got, want)):
            if g != w:
                inner = first_difference(g, w)
                return f"[{i}]{inner}" if inner.startswith("[") else f"[{i}]: expected {_short(w)}, got {_short(g)}"
        if len(got) != len(want):
            return f"length: expected {len(want)}, got {len(got)}"
    return f": expected {_short(want)}, got {_short(got)}"


def expect(got: Any, want: Any, what: str) -> None:
    """Fail with one line that says what was checked, what was expected and what came back.

    For sequences the line names the first differing index and the two values there,
    e.g. ``rows of step 3[1]: expected ('b', 1), got ('c', 4)``.
    """
    __tracebackhide__ = True
    if got != want:
        where = first_difference(got, want)
        sep = "" if where.startswith(":") else " "
        pytest.fail(f"{what}{sep}{where}", pytrace=False)
