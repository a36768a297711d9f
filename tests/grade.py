"""Grade the exercises and print one line per chapter.

Run from the repository root:

    python tests/grade.py                    # every chapter, your code in exercises/
    python tests/grade.py ch00               # one chapter (ch00, ch00_the_model, 00 or 0)
    python tests/grade.py -v                 # every failing test on its own line, in full
    python tests/grade.py --impl solutions --strict   # the reference answers; exit 1 on any failure

Under the table, each unfinished chapter lists the functions still to write (their stubs
raise NotImplementedError) and why tests failed, one line per distinct reason, the first
five reasons only. A reason says what was checked, what was expected and what came back,
e.g. "rows of the step (...): expected [('a', 1), ('b', 2)], got [('a', 1)]", and the line
under it the sentence of the contract that the test checks (the test's docstring).
Tests run smallest case first, so the first reason is the smallest case that fails. With ``-v``
every failing test gets its own line with its whole first line of reason, followed by up
to three more lines of its failure message (both values whole, the contract, or the
tensor comparison's report), and each function to write names the tests waiting on it.

Unfinished exercises are not an error: the exit status is 0 unless pytest itself
could not run, or ``--strict`` is given and a test failed. In a notebook, run
``!python tests/grade.py`` or ``%run tests/grade.py``.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "exercises"
for _path in (ROOT / "tests", ROOT):  # the repository root ends up first on sys.path
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import pytest  # noqa: E402

import adapters  # noqa: E402


@dataclass
class Chapter:
    name: str  # e.g. "ch00_the_model"
    points: dict[str, int] = field(default_factory=dict)  # test id -> points it is worth
    outcome: dict[str, str] = field(default_factory=dict)  # test id -> passed | failed | skipped
    reason: dict[str, str] = field(default_factory=dict)  # test id -> first line of the failure
    more: dict[str, list[str]] = field(default_factory=dict)  # test id -> the lines after it
    contract: dict[str, str] = field(default_factory=dict)  # test id -> the contract it checks (its docstring)
    errors: list[str] = field(default_factory=list)  # collection errors

    def tests(self, outcome: str) -> list[str]:
        return [t for t, o in self.outcome.items() if o == outcome]

    @property
    def graded(self) -> list[str]:  # skipped tests (a missing optional oracle) count for nothing
        return [t for t in self.points if self.outcome.get(t, "failed") != "skipped"]

    @property
    def status(self) -> str:
        passed, graded = self.tests("passed"), self.graded
        if self.errors or not graded or any(r.startswith("could not import") for r in self.reason.values()):
            return "error"
        if len(passed) == len(graded):
            return "done"
        failed = [t for t in graded if t not in passed]
        if not passed and all(self.reason.get(t, "").startswith(adapters.NOT_IMPLEMENTED) for t in failed):
            return "not started"
        return "partial"


class Collector:
    """A pytest plugin that records each exercise test's outcome, points and failure line."""

    def __init__(self) -> None:
        self.chapters: dict[str, Chapter] = {}

    def _chapter(self, path: str) -> Chapter:
        name = Path(path).stem.removeprefix("test_")
        return self.chapters.setdefault(name, Chapter(name))

    def pytest_collection_finish(self, session) -> None:
        for item in session.items:  # after -m deselection
            marker = item.get_closest_marker("exercises")
            points = marker.kwargs.get("points", 1) if marker else 1
            chapter = self._chapter(str(item.path))
            chapter.points[item.nodeid] = points
            doc = getattr(getattr(item, "function", None), "__doc__", None)
            if doc:
                chapter.contract[item.nodeid] = " ".join(doc.split())

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self._chapter(report.nodeid.split("::")[0]).errors.append(_reason_lines(report)[0])

    def pytest_runtest_logreport(self, report) -> None:
        chapter = self._chapter(report.nodeid.split("::")[0])
        if report.failed:  # a failure in setup, call or teardown fails the test
            chapter.outcome[report.nodeid] = "failed"
            if report.nodeid not in chapter.reason:
                first, *more = _reason_lines(report)
                chapter.reason[report.nodeid], chapter.more[report.nodeid] = first, more
        elif report.skipped and report.nodeid not in chapter.outcome:
            chapter.outcome[report.nodeid] = "skipped"
        elif report.when == "call" and report.passed:
            chapter.outcome.setdefault(report.nodeid, "passed")


def _reason_lines(report) -> list[str]:
    """Why a test failed, from the line the table shows on: a message given to pytest.fail
    (the adapters' expect helpers) as it is, else the exception's lines of the traceback,
    from the exception line (``AssertionError: ...``, ``TypeError: ...``) on."""
    text = str(report.longrepr or "")
    errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    lines = [l for l in errors if l] or [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return ["failed"]
    if errors:  # a traceback: start at the exception line
        start = next((i for i, l in enumerate(lines) if l.startswith(("Failed:", "AssertionError"))), 0)
        lines = lines[start:]
        if not lines[0].startswith(("Failed:", "AssertionError")):  # a crash: say where it happened
            where = re.findall(r"^(\S+\.py):(\d+): in (\S+)$", text, flags=re.M)
            if where:
                path, line, func = where[-1]
                lines = lines[:1] + [f"raised at {path}:{line}, in {func}"] + lines[1:]
    lines[0] = lines[0].removeprefix("Failed: ").removeprefix("AssertionError: ")
    return lines


def _first_line(report) -> str:
    """The line the table shows: what was checked, expected and got (or the exception line)."""
    return _reason_lines(report)[0]


def find_chapters(selected: list[str]) -> list[Path]:
    files = sorted(TESTS.glob("test_ch*.py"))
    if not selected:
        return files
    chosen = []
    for want in selected:
        key = want.removeprefix("test_").removesuffix(".py")
        if re.fullmatch(r"\d+", key):
            key = f"ch{int(key):02d}"
        hits = [f for f in files if f.stem.removeprefix("test_").startswith(key)]
        if not hits:
            names = ", ".join(f.stem.removeprefix("test_") for f in files)
            raise SystemExit(f"grade: no chapter matches {want!r}; chapters: {names}")
        chosen += [f for f in hits if f not in chosen]
    return chosen


def run(files: list[Path], impl: str, show_pytest: bool) -> tuple[int, Collector, str]:
    """Run pytest in this process on ``files`` against ``impl``; return its exit code."""
    os.environ[adapters.ENV_VAR] = impl
    collector = Collector()
    args = [str(f) for f in files] + [
        "-p", "no:cacheprovider", f"--rootdir={ROOT}", "-m", "exercises", "-q", "--tb=short",
    ]
    # A second run in the same process (a notebook's %run) must see edited files again.
    for name in [m for m in sys.modules if m.split(".")[0] in (*adapters.IMPLS, *(f.stem for f in files))]:
        del sys.modules[name]
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)  # pyproject.toml (markers) and relative node ids are taken from here
    try:
        if show_pytest:
            code = pytest.main(args, plugins=[collector])
        else:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                code = pytest.main(args, plugins=[collector])
    finally:
        os.chdir(cwd)
    return int(code), collector, out.getvalue()


def table(chapters: list[Chapter], impl: str) -> str:
    rows = [("chapter", "passed / total", "points", "status")]
    total_pass = total_tests = total_pts = max_pts = 0
    for ch in chapters:
        graded = ch.graded
        passed = [t for t in graded if ch.outcome.get(t) == "passed"]
        pts, top = sum(ch.points[t] for t in passed), sum(ch.points[t] for t in graded)
        rows.append((ch.name, f"{len(passed)} / {len(graded)}", f"{pts} / {top}", ch.status))
        total_pass, total_tests, total_pts, max_pts = (
            total_pass + len(passed), total_tests + len(graded), total_pts + pts, max_pts + top)
    if len(chapters) > 1:
        rows.append(("total", f"{total_pass} / {total_tests}", f"{total_pts} / {max_pts}", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    align = [str.ljust, str.rjust, str.rjust, str.ljust]

    def fmt(row) -> str:
        return "  ".join(a(c, w) for a, c, w in zip(align, row, widths)).rstrip()

    rule = "-" * len(fmt(rows[0]))
    lines = [f"Grading {impl}/", "", fmt(rows[0]), rule] + [fmt(r) for r in rows[1:]]
    if len(chapters) > 1:
        lines.insert(-1, rule)
    return "\n".join(lines)


def details(chapters: list[Chapter], impl: str, verbose: bool, limit: int = 5, more_lines: int = 3) -> str:
    """What to do next, per chapter: functions still to write, then failing tests and why.

    Short (the default): one line per distinct reason (tests failing for the same reason
    share it), at most ``limit`` of them. ``verbose``: every failing test on its own line
    with its reason, then up to ``more_lines`` further lines of its message, indented;
    each function to write lists the tests that wait on it."""
    blocks = []
    for ch in chapters:
        failed = [t for t in ch.graded if ch.outcome.get(t) != "passed"]
        if not failed and not ch.errors:
            continue
        lines = [f"{ch.name} ({impl}/{ch.name}.py)"]
        lines += [f"  could not collect the tests: {err}" for err in ch.errors]
        todo: dict[str, list[str]] = {}  # function name -> its tests, in the order the tests meet them
        broken: dict[str, list[str]] = {}  # reason -> tests, so one import error is one line
        for t in failed:
            reason, name = ch.reason.get(t, "failed"), t.split("::", 1)[-1]
            if reason.startswith(adapters.NOT_IMPLEMENTED):
                todo.setdefault(reason.split("::")[-1], []).append(name)
            else:
                broken.setdefault(reason, []).append(t)
        if todo and verbose:
            lines.append("  to write:")
            lines += [f"    {fn} (tests: {', '.join(tests)})" for fn, tests in todo.items()]
        elif todo:
            lines.append(f"  to write: {', '.join(todo)}")
        if verbose:
            for t in (t for tests in broken.values() for t in tests):
                lines.append(f"  FAILED {t.split('::', 1)[-1]}: {ch.reason.get(t, 'failed')}")
                if t in ch.contract:
                    lines.append(f"      contract: {ch.contract[t]}")
                lines += [f"      {line}" for line in ch.more.get(t, [])[:more_lines]]
        else:
            groups = list(broken.items())
            for reason, tests in groups[:limit]:
                names = [t.split("::", 1)[-1] for t in tests]
                shown = names[0] if len(names) == 1 else f"{len(names)} tests ({', '.join(names[:2])}, ...)"
                lines.append(f"  FAILED {shown}: {reason}")
                if tests[0] in ch.contract:
                    lines.append(f"      contract: {ch.contract[tests[0]]}")
            hidden = len(groups) - limit
            tests_with_more = sum(1 for tests in broken.values() for t in tests if ch.more.get(t))
            if hidden > 0:
                lines.append(f"  ... and {hidden} more (python tests/grade.py -v)")
            elif len(failed) - sum(len(v) for v in todo.values()) > len(groups) or tests_with_more:
                lines.append("  (every failing test, in full: python tests/grade.py -v)")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Grade the exercises chapter by chapter.")
    parser.add_argument("chapters", nargs="*", help="chapters to grade, e.g. ch00 (default: all)")
    parser.add_argument("--impl", choices=adapters.IMPLS, default=os.environ.get(adapters.ENV_VAR) or "exercises",
                        help="grade your exercises (default) or the reference solutions")
    parser.add_argument("--strict", action="store_true", help="exit 1 if any test fails (for CI)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="every failing test on its own line, with more of its message")
    parser.add_argument("--pytest-output", action="store_true", help="show pytest's own report as well")
    args = parser.parse_args(argv)

    files = find_chapters(args.chapters)
    if not files:
        print("grade: no chapter tests found in tests/exercises/", file=sys.stderr)
        return 2
    code, collector, output = run(files, args.impl, args.pytest_output)
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        print(output, file=sys.stderr)
        print(f"grade: pytest could not run the tests (exit code {code})", file=sys.stderr)
        return code or 1
    chapters = [collector.chapters.get(f.stem.removeprefix("test_")) or Chapter(f.stem.removeprefix("test_"))
                for f in files]
    print(table(chapters, args.impl))
    notes = details(chapters, args.impl, args.verbose)
    if notes:
        print()
        print(notes)
    if all(ch.status == "done" for ch in chapters):
        print("\nAll graded chapters pass.")
    if args.strict and code != pytest.ExitCode.OK:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
