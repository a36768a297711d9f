"""Execute chapters in place and save them with their outputs: ``make chapters``.

    python tools/run_chapters.py                      # every chapter
    python tools/run_chapters.py chapters/02_*.ipynb  # some

Each chapter runs top to bottom in a fresh kernel, from chapters/, with the learner's
untouched exercises (MINILLM_IMPL=exercises: the "run it in the engine" cells say "not
started" and print no reference answer). Every code cell then records the hash of the
source it ran (``metadata.minillm.source_sha256``); tests/test_chapters_saved.py fails when a
cell's source no longer matches the output saved under it. Saved notebooks stay small: widget
state is dropped, figures are PNG at the inline backend's default size, and paths of this
machine are replaced by placeholders.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
CELL_TIMEOUT = 900  # seconds: a cell past this fails the run (the slowest CPU sweeps take ~5 min)


def source_hash(source: str) -> str:
    """What a code cell's saved outputs were produced from."""
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def _scrub(text: str) -> str:
    """No path of this machine in a saved output: the repository and the home folder."""
    return text.replace(str(ROOT), "<repo>").replace(str(Path.home()), "~")


def _scrub_outputs(cell) -> None:
    for out in cell.get("outputs", []):
        if "text" in out:
            out["text"] = _scrub(out["text"] if isinstance(out["text"], str) else "".join(out["text"]))
        for key in ("text/plain", "text/html", "text/markdown"):
            data = out.get("data", {})
            if key in data:
                value = data[key] if isinstance(data[key], str) else "".join(data[key])
                data[key] = _scrub(value)
        if out.get("output_type") == "error":
            out["traceback"] = [_scrub(line) for line in out.get("traceback", [])]


def run(path: Path) -> float:
    nb = nbformat.read(path, as_version=4)
    env_before = os.environ.get("MINILLM_IMPL")
    os.environ["MINILLM_IMPL"] = "exercises"  # the kernel inherits it: the learner's view
    start = time.perf_counter()
    try:
        NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3", allow_errors=False,
                       record_timing=False, resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        if env_before is None:
            os.environ.pop("MINILLM_IMPL", None)
        else:
            os.environ["MINILLM_IMPL"] = env_before
    seconds = time.perf_counter() - start
    nb.metadata.pop("widgets", None)  # the widget state: kilobytes a widget, useless without a kernel
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.metadata.pop("execution", None)
        cell.metadata.setdefault("minillm", {})["source_sha256"] = source_hash(cell.source)
        _scrub_outputs(cell)
    nbformat.write(nb, path)
    return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="*", type=Path, help="default: chapters/*.ipynb")
    args = ap.parse_args(argv)
    paths = args.notebooks or sorted((ROOT / "chapters").glob("*.ipynb"))
    for path in paths:
        print(f"{path.name}: running ...", flush=True)
        seconds = run(path.resolve())
        print(f"{path.name}: {seconds:.0f} s, saved {path.stat().st_size / 1024:.0f} KiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
