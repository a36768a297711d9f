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


def _pytest(args: list[str]) -> grade.Collector:
    collector = grade.Collector()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = pytest.main(args + ["-p", "no:cacheprovider", f"--rootdir={ROOT}", "-q", "--tb=short",
                                   "-W", "ignore"], plugins=[collector, _Timeout()])
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        raise RuntimeError(f"pytest could not run {args[:2]}... (exit code {code}):\n{out.getvalue()[-3000:]}")
    return collector


def _failures(collector: grade.Collector) -> list[tuple[str, str]]:
    return [(t, ch.reason.get(t, "failed")) for ch in collector.chapters.values()
            for t in ch.outcome if ch.outcome[t] == "failed"]


def baseline(chapter: str) -> dict[str, list[str]]:
    """Grade the reference answers, recording which tests call which function; all must pass."""
    adapters.calls.clear()
    adapters.recording = True
    try:
        collector = _pytest([str(ROOT / "tests" / "exercises" / f"test_{chapter}.py")])
    finally:
        adapters.recording = False
    failed = _failures(collector)
    if failed:
        raise RuntimeError(f"{chapter}: the reference answers fail {len(failed)} tests, e.g. {failed[0]}")
    return {name: sorted(tests) for (ch, name), tests in adapters.calls.items() if ch == chapter}


def engine_check(m: mutants.Mutant) -> str | None:
    """For a seam's mutant: the engine check's first problem ('' if none); None for other functions."""
    from minillm import seams
    from minillm.course import edges

    if m.function not in seams.SEAMS:
        return None
    if m.same_in_engine:
        return f"the same decisions by construction: {m.same_in_engine}"
    problems = edges.check(m.chapter, {m.function: m.fn})
    return problems[0] if problems else ""


def run_chapter(chapter: str, engine: bool = True) -> list[Verdict]:
    os.environ[adapters.ENV_VAR] = "solutions"
    callers = baseline(chapter)
    verdicts = []
    for m in mutants.of(chapter):
        tests = callers.get(m.function, [])
        v = Verdict(m, ran=len(tests))
        if tests:
            adapters.substitute(chapter, m.function, m.fn)
            try:
                v.failed = _failures(_pytest(tests))
            finally:
                adapters.substitute(chapter, m.function, None)
        if engine:
            v.engine = engine_check(m)
        verdicts.append(v)
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
        bad += len(missed)
        print(f"{chapter}: {len(verdicts)} mutants of {len({v.mutant.function for v in verdicts})} functions, "
              f"{len(verdicts) - len(missed)} caught; seam mutants the engine rejects: "
              f"{sum(1 for v in seams_ if v.engine)} of {len(seams_)} ({time.perf_counter() - t0:.1f} s)")
        for v in (verdicts if args.verbose else missed):
            print(f"  {'caught' if v.caught else 'NOT CAUGHT'}: {v.describe()}")
    return 1 if args.strict and bad else 0


if __name__ == "__main__":
    sys.exit(main())
