"""Plausible wrong answers to the exercises: a grader is only as good as the mistakes it fails.

One module per chapter, named like the exercise file (``tests/mutants/ch02_continuous_batching.py``),
holds functions with an exercise's signature, each carrying one mistake a learner makes
(a budget not charged, an off-by-one at a block edge, a queue order broken, a softmax not
renormalised, a missed stop condition, an acceptance rule that is nearly right). They are
written from the contract in the exercise's docstring, not by editing the reference code,
and registered with ``@mutant``::

    @mutant("schedule_step", "the running requests' decode tokens are not charged to the budget")
    def schedule_step(running, waiting, max_num_seqs, max_num_batched_tokens):
        ...

``tests/mutation.py`` grades each one in place of the reference answer and requires the
chapter's tests to fail it with a line that says what was expected and what came back;
for a seam (``minillm/seams.py``), the chapter's engine check must reject it too.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Mutant:
    chapter: str  # e.g. "ch02_continuous_batching"
    function: str  # the exercise function it stands in for
    mistake: str  # the learner's mistake, in the contract's words
    fn: Callable[..., Any]
    # For a seam's mutant whose mistake the engine cannot show (it never calls the function
    # where the mistake matters): why. The engine check then does not have to reject it.
    same_in_engine: str = ""

    @property
    def label(self) -> str:
        return f"{self.function}: {self.mistake}"


_REGISTRY: dict[str, list[Mutant]] = {}


def mutant(function: str, mistake: str, same_in_engine: str = "") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as a wrong answer to ``function`` of this module's chapter.

    ``same_in_engine``: for a seam, why the engine cannot tell this mutant from the right
    answer (e.g. "the engine removes finished requests before it calls the step"); use it
    only when that holds by construction, never because no edge case reaches the mistake."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        chapter = fn.__module__.rsplit(".", 1)[-1]
        found = _REGISTRY.setdefault(chapter, [])
        if any(m.function == function and m.mistake == mistake for m in found):
            raise ValueError(f"{chapter}: two mutants of {function} share the mistake {mistake!r}")
        found.append(Mutant(chapter, function, mistake, fn, same_in_engine))
        return fn

    return register


def chapters() -> list[str]:
    """Chapters that have a mutants module."""
    return sorted(p.stem for p in HERE.glob("ch*.py"))


def of(chapter: str) -> list[Mutant]:
    """The mutants of ``chapter`` (e.g. "ch02_continuous_batching"), in the order they are written."""
    importlib.import_module(f"mutants.{chapter}")
    return list(_REGISTRY.get(chapter, []))
