"""Chapters are saved executed (``make chapters``): every code cell's outputs are those of the
source it shows. A cell edited after the run, or a chapter saved without its outputs, fails here;
CI still executes every chapter under nbval."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))
MAX_SAVED_BYTES = 3 * 1024 * 1024  # a chapter with its charts; PNGs at the inline backend's size


def source_hash(source: str) -> str:  # as tools/run_chapters.py writes it
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def code_cells(path: Path) -> list[dict]:
    nb = json.loads(path.read_text())
    return [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_every_cell_was_executed_from_the_source_it_shows(path):
    stale = []
    for i, cell in enumerate(code_cells(path)):
        saved = cell.get("metadata", {}).get("minillm", {}).get("source_sha256")
        if saved != source_hash("".join(cell["source"])):
            first = "".join(cell["source"]).strip().splitlines()[0][:60]
            stale.append(f"code cell {i} ({first!r}): " + ("never executed by make chapters" if saved is None
                                                           else "edited after its outputs were saved"))
    assert not stale, f"{path.name}: run `make chapters` (tools/run_chapters.py) again:\n" + "\n".join(stale)


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_saved_outputs_are_whole_small_and_of_no_machine(path):
    cells = code_cells(path)
    assert cells and all(c.get("execution_count") for c in cells), f"{path.name}: a code cell was not run"
    with_output = sum(1 for c in cells if c.get("outputs"))
    assert with_output >= 0.7 * len(cells), f"{path.name}: only {with_output} of {len(cells)} code cells have output"
    errors = [i for i, c in enumerate(cells) if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
    assert not errors, f"{path.name}: code cells {errors} saved an error"
    text = path.read_text()
    assert str(ROOT) not in text and str(Path.home()) + "/" not in text, f"{path.name}: a path of this machine"
    assert not re.search(r"[?&]token=\w{16,}", text), f"{path.name}: a server token in an output"
    assert path.stat().st_size < MAX_SAVED_BYTES, f"{path.name}: {path.stat().st_size} bytes saved"
    assert "widgets" not in json.loads(text).get("metadata", {}), f"{path.name}: widget state saved"


def test_widgets_draw_their_first_figure_as_a_saved_output():
    """An explorer's first chart is an ordinary output: the saved chapter shows it without a kernel."""
    found = 0
    for path in CHAPTERS:
        for i, cell in enumerate(code_cells(path)):
            if "charts.explorer(" in "".join(cell["source"]):
                found += 1
                pngs = [o for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
                assert pngs, f"{path.name}, code cell {i}: the explorer saved no figure"
    assert found, "no chapter has an explorer: this test checks nothing"
