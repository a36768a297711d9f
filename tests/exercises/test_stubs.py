"""The exercise files as shipped: every stub imports, raises NotImplementedError, and
has the signature of its solution. These checks ignore MINILLM_IMPL.

Chapters are discovered from exercises/ch*.py, so a new chapter is covered the moment
its file exists. (A learner who has started the exercises will see these fail; grade
with tests/grade.py, which runs only the chapter tests.)
"""
from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.exercises

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = sorted(p.stem for p in (ROOT / "exercises").glob("ch*.py"))


def _public_functions(module: ModuleType) -> dict[str, object]:
    """Functions defined in the module itself (not imported), without a leading underscore."""
    return {
        name: fn for name, fn in inspect.getmembers(module, inspect.isfunction)
        if not name.startswith("_") and fn.__module__ == module.__name__
    }


def _shape(fn) -> list[tuple[str, object, object, str]]:
    """What must match between a stub and its solution: name, kind, default, annotation."""
    def annotation(a) -> str:
        return a if isinstance(a, str) else inspect.formatannotation(a)

    sig = inspect.signature(fn)
    params = [(p.name, p.kind, p.default, annotation(p.annotation)) for p in sig.parameters.values()]
    return params + [("return", None, None, annotation(sig.return_annotation))]


def test_chapters_exist():
    assert CHAPTERS, "exercises/ must hold at least one chNN_topic.py module"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_is_complete(chapter):
    assert (ROOT / "solutions" / f"{chapter}.py").is_file(), f"exercises/{chapter}.py needs solutions/{chapter}.py"
    tests = ROOT / "tests" / "exercises" / f"test_{chapter}.py"
    assert tests.is_file(), f"exercises/{chapter}.py needs its grading tests in tests/exercises/test_{chapter}.py"
    stubs = _public_functions(importlib.import_module(f"exercises.{chapter}"))
    assert stubs, f"exercises/{chapter}.py defines no public function"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_stubs_raise_not_implemented(chapter):
    module = importlib.import_module(f"exercises.{chapter}")
    for name, fn in _public_functions(module).items():
        assert inspect.getdoc(fn), f"exercises/{chapter}.py::{name} needs a docstring (shapes, contract, hints)"
        args, kwargs = [], {}
        for p in inspect.signature(fn).parameters.values():
            if p.default is not inspect.Parameter.empty:
                continue
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                args.append(None)
            elif p.kind is p.KEYWORD_ONLY:
                kwargs[p.name] = None
        # A stub's first statement is `raise NotImplementedError`, so None arguments are fine.
        try:
            fn(*args, **kwargs)
        except NotImplementedError:
            continue
        except Exception as e:
            pytest.fail(f"exercises/{chapter}.py::{name} must raise NotImplementedError as its first statement, "
                        f"raised {type(e).__name__}: {e}")
        pytest.fail(f"exercises/{chapter}.py::{name} returned instead of raising NotImplementedError: "
                    f"the shipped exercise must be a stub")


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_solution_signatures_match(chapter):
    stubs = _public_functions(importlib.import_module(f"exercises.{chapter}"))
    solution = importlib.import_module(f"solutions.{chapter}")
    missing = sorted(n for n in stubs if not callable(getattr(solution, n, None)))
    assert not missing, f"solutions/{chapter}.py lacks {', '.join(missing)}"
    extra = sorted(set(_public_functions(solution)) - set(stubs))
    assert not extra, (
        f"solutions/{chapter}.py defines public functions with no exercise: {', '.join(extra)} "
        f"(prefix helpers with an underscore)"
    )
    for name, stub in stubs.items():
        sol = getattr(solution, name)
        assert _shape(stub) == _shape(sol), (
            f"{chapter}.{name}: the exercise and the solution must have the same signature\n"
            f"  exercises: {inspect.signature(stub)}\n  solutions: {inspect.signature(sol)}"
        )
