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
import re
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


# (chapter, name) -> a function that takes the place of ``<impl>.<chapter>.<name>``: the
# mutation runner (tests/mutation.py) plugs a plausible wrong answer in here and checks
# that the grader fails it. Empty when a learner grades their own code.
_substitutes: dict[tuple[str, str], Callable[..., Any]] = {}
# (chapter, name) -> node ids of the tests that called it, in the order they ran (a dict used
# as an ordered set), filled while ``recording``.
calls: dict[tuple[str, str], dict[str, None]] = {}
recording = False


def substitute(chapter: str, name: str, fn: Callable[..., Any] | None) -> None:
    """Grade ``fn`` in place of ``<impl>.<chapter>.<name>`` (None: back to the file's own)."""
    if fn is None:
        _substitutes.pop((chapter, name), None)
    else:
        _substitutes[(chapter, name)] = fn


def _record(chapter: str, name: str) -> None:
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    if test:
        calls.setdefault((chapter, name), {})[test] = None


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
        if recording:
            _record(chapter, name)
        if (chapter, name) in _substitutes:
            return _substitutes[(chapter, name)](*args, **kwargs)
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
    text = re.sub(r"\s*\n\s*", " ", repr(value))  # one line, e.g. for a tensor's repr
    return text if len(text) <= limit else text[:limit - 5] + " ...)"


def first_difference(got: Any, want: Any) -> str:
    """Where ``got`` first differs from ``want``: an index (nested for lists of lists; a tuple
    is one value, e.g. a row (request id, tokens)), or where one list ends before the other."""
    if isinstance(got, list) and isinstance(want, list):
        for i, (g, w) in enumerate(zip(got, want)):
            if g != w:
                inner = first_difference(g, w)
                return f"[{i}]{inner}" if inner.startswith("[") else f"[{i}]: expected {_short(w)}, got {_short(g)}"
        n = min(len(got), len(want))
        if len(got) > len(want):
            return f"[{n}]: expected the end (length {len(want)}), got {_short(got[n])} (length {len(got)})"
        if len(got) < len(want):
            return f"[{n}]: expected {_short(want[n])}, got the end (length {len(got)})"
    return f": expected {_short(want)}, got {_short(got)}"


def _fail(first: str, *more: str) -> None:
    """Fail with ``first`` as the line the grader shows; ``more`` lines follow it (grade.py -v)."""
    __tracebackhide__ = True
    pytest.fail("\n".join([first, *(f"  {m}" for m in more if m)]), pytrace=False)


def expect(got: Any, want: Any, what: str) -> None:
    """Fail with one line that says what was checked, what was expected and what came back.

    For sequences the line names the first differing index and the two values there,
    e.g. ``rows of step 3[1]: expected ('b', 1), got ('c', 4)``; the lines after it
    (shown by ``grade.py -v``) hold both values whole.
    """
    __tracebackhide__ = True
    if got != want:
        where = first_difference(got, want)
        sep = "" if where.startswith(":") else " "
        more = (f"expected {_short(want, 400)}", f"got      {_short(got, 400)}") if where.startswith("[") else ()
        _fail(f"{what}{sep}{where}", *more)


def expect_all(got: Any, want: Any, what: str) -> None:
    """Like ``expect``, but the line shows both values whole: ``<what>: expected [..], got [..]``
    (for short lists, e.g. the rows of one step, where the whole says more than an index).
    The next line names the first differing index."""
    __tracebackhide__ = True
    if got != want:
        where = first_difference(got, want)
        _fail(f"{what}: expected {_short(want, 300)}, got {_short(got, 300)}",
              f"first difference {where.lstrip(': ')}" if where.startswith("[") else "")


def expect_that(ok: Any, what: str, expected: str, got: Any, note: str = "") -> None:
    """For checks that are not an equality: ``<what>: expected <expected>, got <got>``.

    ``expected`` describes what passes (e.g. "fewer than 1067 steps"); ``got`` is what came
    back (a string is shown as it is); ``note`` is an optional second line (the contract)."""
    __tracebackhide__ = True
    if not ok:
        _fail(f"{what}: expected {expected}, got {got if isinstance(got, str) else _short(got)}", note)


def expect_approx(got: Any, want: float, what: str, rel: float = 1e-6, abs: float = 1e-12,
                  unit: str = "") -> None:
    """``got`` equals ``want`` to a relative ``rel`` (or absolute ``abs``) tolerance, as pytest.approx."""
    __tracebackhide__ = True
    ok = isinstance(got, (int, float)) and not isinstance(got, bool) and got == pytest.approx(want, rel=rel, abs=abs)
    shown = f"{got:.9g}{unit}" if isinstance(got, (int, float)) and not isinstance(got, bool) else _short(got)
    expect_that(ok, what, f"{want:.9g}{unit} (to a relative {rel:g})", shown)


def expect_raises(exc: type[BaseException], what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """``fn(*args, **kwargs)`` raises ``exc``: ``<what>: expected ValueError, got <the return value>``."""
    __tracebackhide__ = True
    try:
        value = fn(*args, **kwargs)
    except exc:
        return
    except Exception as e:  # not pytest.fail (a stub's "not implemented yet" passes through)
        got = f"{type(e).__name__}: {e}"
    else:
        got = f"a return value, {_short(value)}"
    _fail(f"{what}: expected {exc.__name__}, got {got}")


def shape_of(x: Any) -> Any:
    """``tuple(x.shape)`` for a tensor, else a string naming what ``x`` is (for ``expect``)."""
    shape = getattr(x, "shape", None)
    return tuple(shape) if shape is not None else f"a {type(x).__name__}, not a tensor"


# torch.testing.assert_close's default (rtol, atol) by dtype
_DEFAULT_TOL = {"float16": (1e-3, 1e-5), "bfloat16": (1.6e-2, 1e-5), "float32": (1.3e-6, 1e-5),
                "float64": (1e-7, 1e-7)}


def expect_close(got: Any, want: Any, what: str, *, atol: float | None = None, rtol: float | None = None,
                 equal_nan: bool = False, check_dtype: bool = True, note: str = "") -> None:
    """``torch.testing.assert_close(got, want)``, reported as one line first:

        <what>: 3 of 384 values differ; first at [0, 1, 5]: expected 0.1234, got 0.1301;
        max abs error 0.0067 at [0, 1, 5] (atol 1e-05, rtol 1e-05)

    then ``note`` (the contract) and torch.testing's own report on the lines after it."""
    __tracebackhide__ = True
    import torch

    if not isinstance(got, torch.Tensor):
        _fail(f"{what}: expected a tensor of shape {tuple(want.shape)}, got {_short(got)}", note)
    if got.shape != want.shape:
        _fail(f"{what}: expected shape {tuple(want.shape)}, got {tuple(got.shape)}", note)
    if check_dtype and got.dtype != want.dtype:
        _fail(f"{what}: expected dtype {want.dtype}, got {got.dtype}", note)
    try:
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol, equal_nan=equal_nan, check_dtype=check_dtype)
    except AssertionError as e:
        report = str(e)
    else:
        return
    if atol is None or rtol is None:
        dflt = [_DEFAULT_TOL.get(str(t.dtype).removeprefix("torch."), (0.0, 0.0)) for t in (got, want)]
        rtol, atol = max(d[0] for d in dflt), max(d[1] for d in dflt)
    g, w = got.detach().cpu().double(), want.detach().cpu().double()
    err = (g - w).abs()
    both_nan = g.isnan() & w.isnan()
    close = (err <= atol + rtol * w.abs()) | (g == w) | (both_nan if equal_nan else torch.zeros_like(both_nan))
    bad = ~close
    first = bad.flatten().nonzero()
    if len(first) == 0:  # not a value mismatch (device, layout): torch's first line says what
        _fail(f"{what}: {report.splitlines()[0]}", note, *report.splitlines()[1:])

    def at(flat: int) -> str:
        return f" at {[int(i) for i in torch.unravel_index(torch.tensor(flat), g.shape)]}" if g.dim() else ""

    i = int(first[0])
    errs = err.flatten().nan_to_num(nan=float("inf"))
    errs[~bad.flatten()] = -1.0
    j = int(errs.argmax())
    line = (f"{what}: expected {w.item():.6g}, got {g.item():.6g}; abs error {err.item():.3g} "
            f"(atol {atol:g}, rtol {rtol:g})") if g.dim() == 0 else (
            f"{what}: {int(bad.sum())} of {g.numel()} values differ; first{at(i)}: "
            f"expected {w.flatten()[i].item():.6g}, got {g.flatten()[i].item():.6g}; "
            f"max abs error {err.flatten()[j].item():.3g}{at(j)} (atol {atol:g}, rtol {rtol:g})")
    _fail(line, note, *[l for l in report.splitlines() if l.strip()])
