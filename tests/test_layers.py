"""The package's floor plan: an import only points down, no module imports itself in a
circle (function-local imports count), and the package face loads nothing until used.

The layers, bottom to top (README, "Layout"). A module may import modules of its own layer
or below; the cycle check keeps one layer's modules from importing each other in a circle.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minillm"

LAYERS = [
    # 1. leaves: plain values and records, no torch needed to read them
    ["minillm", "minillm.config", "minillm.sampling_params", "minillm.request", "minillm.clock", "minillm.seams",
     "minillm.metrics", "minillm.cache", "minillm.inputs", "minillm.detokenizer", "minillm.threads", "minillm.slo",
     "minillm.candidate_tree"],
    # 2. kernels (Triton; the CPU's C++ with its build and bindings) and where they run
    ["minillm.kernels*", "minillm.placement"],
    # 3. the model and its attention; weights from the GGUF
    ["minillm.attention", "minillm.model", "minillm.quantization", "minillm.loader", "minillm.compiled"],
    # 4. who runs when and where its K/V lives
    ["minillm.block_manager", "minillm.kv_offload", "minillm.scheduler*", "minillm.spec_decode",
     "minillm.spec_decode.policy"],
    # 5. one step's forward, sampling, drafting and verifying; the forward split over processes
    ["minillm.model_runner", "minillm.host_kv", "minillm.sampling", "minillm.spec_decode.*", "minillm.distributed*"],
    # 6. the engine: resolves the hardware, builds everything, steps
    ["minillm.resolve", "minillm.engine"],
    # 7. serving online
    ["minillm.serving*"],
    # 8. the measuring kit and the course
    ["minillm.bench*", "minillm.course*", "minillm.viz*"],
    # 9. the command line
    ["minillm.__main__"],
]


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def layer_of(name: str) -> int:
    best = None
    for i, patterns in enumerate(LAYERS, start=1):
        for pat in patterns:
            exact = not pat.endswith("*")
            stem = pat.rstrip("*").rstrip(".")
            if (exact and name == pat) or (not exact and (name == stem or name.startswith(stem + "."))):
                length = len(stem) + (1 if exact else 0)  # an exact name beats a wildcard of the same stem
                if best is None or length > best[0]:
                    best = (length, i)
    assert best is not None, f"{name} is in no layer of tests/test_layers.py: place it"
    return best[1]


def import_graph() -> dict[str, set[str]]:
    """Module -> the minillm modules it imports anywhere in its body (function-local included).
    ``from pkg import sub`` is an edge to the submodule; to ``pkg`` only for names that are not modules."""
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                subs = [f"{base}.{a.name}" for a in node.names]
                targets = [s for s in subs if s in mods]
                if len(targets) < len(subs):
                    targets.append(base)
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    graph[name].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles (function-local imports count): " + "; ".join(" <-> ".join(c) for c in found)


def test_imports_point_down():
    upward = [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
              for a, targets in import_graph().items() for b in sorted(targets) if layer_of(b) > layer_of(a)]
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def test_the_checks_can_fail():
    """The graph sees a function-local import, and the cycle finder finds a circle."""
    graph = import_graph()
    assert "minillm.engine" in graph["minillm.__main__"]  # imported inside main()
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_of("minillm.spec_decode.policy") < layer_of("minillm.spec_decode.drafters")


@pytest.mark.parametrize("module", ["minillm", "minillm.scheduler", "minillm.seams", "minillm.spec_decode.policy",
                                    "minillm.bench.loadgen", "minillm.config", "minillm.request",
                                    "minillm.block_manager", "minillm.sampling_params", "minillm.slo"])
def test_plain_python_modules_do_not_load_torch(module):
    """In a fresh interpreter: these modules promise plain Python; importing them loads no torch."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False", f"import {module} loaded torch"


def test_package_face_is_lazy():
    code = ("import sys, minillm; before = 'minillm.engine' in sys.modules; "
            "minillm.SamplingParams; print(before, 'minillm.engine' in sys.modules, minillm.LLM.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ["False", "False", "LLM"]
