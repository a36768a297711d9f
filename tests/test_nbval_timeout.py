"""A hung notebook cell fails `make test` in minutes, naming the cell, instead of after nbval's 2000 s default.

The option is read from the Makefile's own notebook command lines, so dropping it there
fails this test; the run itself uses a one-cell notebook that sleeps and a small timeout.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NBVAL_DEFAULT_S = 2000  # nbval's own --nbval-cell-timeout: half an hour of a hung kernel per cell
OPTION = re.compile(r"^--nbval-cell-timeout=(\d+(?:\.\d+)?)$")

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="reads the Makefile's targets with make -n")


def make_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}


def nbval_command(target: str) -> list[str]:
    """The pytest --nbval-lax command line `make <target>` runs, variables expanded (make -n runs nothing)."""
    out = subprocess.run(["make", "--no-print-directory", "-n", "-o", "setup", target], cwd=ROOT, env=make_env(),
                         capture_output=True, text=True, timeout=60, check=True).stdout
    lines = [shlex.split(line) for line in out.splitlines() if "--nbval-lax" in line]
    assert len(lines) == 1, f"`make {target}` should run the notebooks once:\n{out}"
    return lines[0]


def cell_timeout_arg(cmd: list[str]) -> str:
    args = [a for a in cmd if OPTION.match(a)]
    assert len(args) == 1, f"no --nbval-cell-timeout=SECONDS in {shlex.join(cmd)}"
    return args[0]


@pytest.mark.parametrize("target", ["test", "test-notebooks"])
def test_makefile_bounds_every_cell(target):
    seconds = float(OPTION.match(cell_timeout_arg(nbval_command(target))).group(1))
    assert 0 < seconds < NBVAL_DEFAULT_S, seconds


@pytest.mark.parametrize("hang", [
    "",                                               # busy: the interrupt gives a traceback
    "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n",   # deaf to it: nbval stops the kernel
], ids=["interruptible", "ignores-interrupt"])
def test_a_hanging_cell_fails_fast_and_is_named(tmp_path, hang):
    cmd = nbval_command("test-notebooks")
    limit_s, sleep_s = 3, 300
    notebook = tmp_path / "hangs.ipynb"
    notebook.write_text(json.dumps({
        "nbformat": 4, "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "cells": [{"cell_type": "code", "id": "c0", "metadata": {}, "execution_count": None, "outputs": [],
                   "source": f"{hang}import time\ntime.sleep({sleep_s})  # stands in for a hung cell"}],
    }))
    # The Makefile's own options, with our notebook instead of chapters/ and a short limit.
    option = cell_timeout_arg(cmd)
    nbval_opts = [a for a in cmd[cmd.index("pytest") + 1:] if a.startswith("--")]
    nbval_opts[nbval_opts.index(option)] = option.split("=")[0] + f"={limit_s}"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *nbval_opts, str(notebook)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=sleep_s)
    elapsed = time.monotonic() - t0
    out = r.stdout + r.stderr
    assert r.returncode == 1, out                           # tests failed (not a usage error or a crash)
    assert f"Timeout of {limit_s} seconds exceeded" in out, out
    assert "hangs.ipynb::Cell 0" in out and "stands in for a hung cell" in out, out   # the cell, by name and source
    assert elapsed < sleep_s / 2, f"took {elapsed:.0f} s: the sleep ran out, not the timeout"
