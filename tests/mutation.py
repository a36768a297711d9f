"""Mutation testing of the graders: every plausible wrong answer must fail, saying what differed.

For each chapter, the reference answers (solutions/) are graded once while recording
which tests call which exercise function. Then each mutant of ``tests/mutants/<chapter>.py``
takes the place of its function and the tests that call that function run again. A
mutant is *caught* when at least one of them fails with a line that says what was
expected and what came back; a failure of another kind (a crash, a bare assert) is
reported as a grader that fails without saying why. For a mutant of a seam (a function
the engine can run, ``minillm/seams.py``), the chapter's engine check
(``minillm/course/edges``) must reject it as well: plugged into the engine on workloads
that reach the edges, it makes the engine decide differently from the library, or the
engine stops on a broken invariant.

    python tests/mutation.py                 # every chapter with mutants
    python tests/mutation.py ch02 -v         # one chapter, every mutant's failure line
    python tests/mutation.py --strict        # exit 1 if a mutant is missed (CI)
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT / "tests", ROOT):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import pytest  # noqa: E402

import adapters  # noqa: E402
import grade  # noqa: E402
import mutants  # noqa: E402

TEST_TIMEOUT_S = 60  # a test that runs longer under a mutant is stopped: the grader hangs on it
EXPECTED_GOT = re.compile(r"expected\b.*\bgot\b", re.I | re.S)


@dataclass
class Verdict:
    mutant: mutants.Mutant
    failed: list[tuple[str, str]] = field(default_factory=list)  # (test id, first line of its reason)
    ran: int = 0
    engine: str | None = None  # for a seam: the engine check's first problem, "" if it found none

    @property
    def told(self) -> list[tuple[str, str]]:
        """Failures that say what was expected and what came back."""
        return [(t, r) for t, r in self.failed if EXPECTED_GOT.search(r)]

    @property
    def caught(self) -> bool:
        return bool(self.told) and self.engine != ""

    def describe(self) -> str:
        if not self.failed:
            grader = f"MISSED: {self.ran} tests ran, none failed"
        elif not self.told:
            test, reason = self.failed[0]
            grader = f"FAILS WITHOUT SAYING WHAT DIFFERED: {test.split('::', 1)[-1]}: {reason}"
        else:
            test, reason = self.told[0]
            grader = f"{test.split('::', 1)[-1]}: {reason}"
        line = f"{self.mutant.label}\n      grader: {grader}"
        if self.engine is not None:
            line += f"\n      engine: {self.engine or 'MISSED: the engine check found nothing wrong'}"
        return line


class _Timeout:
    """Stops a test that runs past ``TEST_TIMEOUT_S`` (a mutant that loops forever)."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        def stop(signum, frame):
            raise TimeoutError(f"the test ran past {TEST_TIMEOUT_S} s (does the function ever return?)")

        old = signal.signal(signal.SIGALRM, stop)
        signal.alarm(TEST_TIMEOUT_S)
        try:
            yield
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)


class _Grader:
    """A pytest plugin that grades, in ONE session: the reference answers once (recording which
    tests call which function; all must pass), then each mutant in place of its function, in
    the tests that call it, in the order they ran. One session keeps the module's fixtures
    (a model loaded once) and spares a collection per mutant."""

    def __init__(self, chapter: str, found: list[mutants.Mutant]):
        self.chapter, self.found = chapter, found
        self.failed: dict[int, list[tuple[str, str]]] = {}  # mutant index -> (test id, reason)
        self.ran: dict[int, int] = {}
        self.error = ""

    def _run(self, items, item) -> list[tuple[str, str]]:
        from _pytest.runner import runtestprotocol

        # Tear down this test's own fixtures but keep its module's: the next test to run is
        # another one of the same module (any other will do; the last call tears down all).
        other = next((i for i in items if i is not item), None)
        reports = runtestprotocol(item, nextitem=other, log=False)
        return [(item.nodeid, grade._reason_lines(r)[0]) for r in reports if r.failed][:1]

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session):
        items = session.items
        by_id = {i.nodeid: i for i in items}
        adapters.calls.clear()
        adapters.recording = True
        try:
            broken = [f for item in items for f in self._run(items, item)]
        finally:
            adapters.recording = False
        if broken:
            self.error = f"{self.chapter}: the reference answers fail {len(broken)} tests, e.g. {broken[0]}"
            session._setupstate.teardown_exact(None)
            return True
        callers = {name: list(tests) for (ch, name), tests in adapters.calls.items() if ch == self.chapter}
        for k, m in enumerate(self.found):
            tests = [by_id[t] for t in callers.get(m.function, []) if t in by_id]
            self.ran[k] = len(tests)
            adapters.substitute(self.chapter, m.function, m.fn)
            try:
                self.failed[k] = [f for item in tests for f in self._run(items, item)]
            finally:
                adapters.substitute(self.chapter, m.function, None)
        session._setupstate.teardown_exact(None)
        return True


def grade_mutants(chapter: str, found: list[mutants.Mutant]) -> list[Verdict]:
    """Each mutant graded by the chapter's tests (see ``_Grader``)."""
    plugin = _Grader(chapter, found)
    out = io.StringIO()
    args = [str(ROOT / "tests" / "exercises" / f"test_{chapter}.py"), "-p", "no:cacheprovider",
            f"--rootdir={ROOT}", "-q", "--tb=short", "-W", "ignore"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = pytest.main(args, plugins=[plugin, _Timeout()])
    if plugin.error:
        raise RuntimeError(plugin.error)
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED) or len(plugin.ran) != len(found):
        raise RuntimeError(f"pytest could not run the tests of {chapter} (exit code {code}):\n{out.getvalue()[-3000:]}")
    return [Verdict(m, failed=plugin.failed.get(k, []), ran=plugin.ran[k]) for k, m in enumerate(found)]


def engine_check(m: mutants.Mutant) -> str | None:
    """For a seam's mutant: the engine check's first problem ('' if none); None for other functions."""
    from minillm import seams
    from minillm.course import edges

    if m.function not in seams.SEAMS:
        return None
    if m.same_in_engine:
        return f"the same decisions by construction: {m.same_in_engine}"
    problems = edges.check(m.chapter, {m.function: m.fn}, first=True)
    return problems[0] if problems else ""


def run_chapter(chapter: str, engine: bool = True) -> list[Verdict]:
    os.environ[adapters.ENV_VAR] = "solutions"
    verdicts = grade_mutants(chapter, mutants.of(chapter))
    if engine:
        for v in verdicts:
            v.engine = engine_check(v.mutant)
    return verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check that every chapter's grader fails its mutants.")
    parser.add_argument("chapters", nargs="*", help="e.g. ch02 (default: every chapter with mutants)")
    parser.add_argument("-v", "--verbose", action="store_true", help="every mutant, caught or not")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a mutant is not caught")
    parser.add_argument("--no-engine", action="store_true", help="skip the engine checks of seam mutants")
    args = parser.parse_args(argv)
    known = mutants.chapters()
    chosen = [c for c in known if not args.chapters or any(c.startswith(grade.find_chapters([a])[0].stem[5:])
                                                            for a in args.chapters)]
    bad = 0
    for chapter in chosen:
        t0 = time.perf_counter()
        verdicts = run_chapter(chapter, engine=not args.no_engine)
        missed = [v for v in verdicts if not v.caught]
        seams_ = [v for v in verdicts if v.engine is not None]
        same = sum(1 for v in seams_ if v.mutant.same_in_engine)
        bad += len(missed)
        print(f"{chapter}: {len(verdicts)} mutants of {len({v.mutant.function for v in verdicts})} functions, "
              f"{len(verdicts) - len(missed)} caught; seam mutants the engine rejects: "
              f"{sum(1 for v in seams_ if v.engine and not v.mutant.same_in_engine)} of {len(seams_) - same}"
              f"{f' (and {same} it cannot tell apart by construction)' if same else ''} "
              f"({time.perf_counter() - t0:.1f} s)")
        for v in (verdicts if args.verbose else missed):
            print(f"  {'caught' if v.caught else 'NOT CAUGHT'}: {v.describe()}")
    return 1 if args.strict and bad else 0


if __name__ == "__main__":
    sys.exit(main())
