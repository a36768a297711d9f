"""The shape of one engine step, kept as the chapters describe it.

* scheduler/, request and block manager are plain Python: no torch, no model runner;
* the speculator holds no scheduler and no runner: the scheduler reserves drafts' KV;
* every scheduler keeps its KV space in a block manager and admits through one method.
"""
import ast
import inspect
from pathlib import Path

import pytest

import minillm
from minillm.scheduler import SCHEDULERS, ContinuousScheduler, PagedScheduler, Scheduler, StaticScheduler
from minillm.spec_decode.speculator import Speculator

PKG = Path(minillm.__file__).parent


def _imports(path: Path) -> set[str]:
    """Absolute module names a file imports when it loads (module level; relative imports resolved).

    Imports inside functions run only when called, and ``if TYPE_CHECKING:`` ones never.
    """
    mod = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
    pkg = mod.rsplit(".", 1)[0] if path.name != "__init__.py" else mod.removesuffix(".__init__")
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)
    return out


def _closure(start: list[str]) -> set[str]:
    """Every module reachable from ``start`` through imports inside minillm (and the leaves outside)."""
    seen, todo = set(), list(start)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        if not m.startswith("minillm"):
            continue
        parts = m.split(".")[1:]
        if not parts:
            continue  # the package itself: a file importing minillm.x loads minillm/x.py, checked on its own
        rel = Path(*parts)
        for cand in (PKG / rel.with_suffix(".py"), PKG / rel / "__init__.py"):
            if cand.exists():
                todo.extend(_imports(cand))
                break
    return seen


def test_scheduler_imports_no_torch_and_no_runner():
    files = [p for p in (PKG / "scheduler").glob("*.py")]
    start = [".".join(p.relative_to(PKG.parent).with_suffix("").parts) for p in files]
    reach = _closure(start)
    assert not {m for m in reach if m == "torch" or m.startswith("torch.")}, "scheduler/ reaches torch"
    assert "minillm.model_runner" not in reach and "minillm.engine" not in reach


def test_the_import_check_sees_torch():
    # the check above can fail: the runner's closure does contain torch
    assert "torch" in _closure(["minillm.model_runner"])


def test_speculator_holds_no_scheduler_or_runner():
    params = inspect.signature(Speculator.__init__).parameters
    assert list(params) == ["self", "config", "drafter"]
    src = inspect.getsource(Speculator)
    assert "block_manager" not in src and "scheduler." not in src


@pytest.mark.parametrize("cls", [ContinuousScheduler, StaticScheduler, PagedScheduler])
def test_one_admission_and_one_update(cls):
    # policies implement schedule(); the queue, KV and update machinery is the base class's
    for name in ("admit", "add_row", "append_token", "can_admit"):
        assert getattr(cls, name) is getattr(Scheduler, name)
    # a policy may look at what finished (the barrel empties, memory comes back), on top of the one update
    assert cls.update is Scheduler.update or "super().update(out, emitted, now)" in inspect.getsource(cls.update)
    assert len(inspect.getsource(cls.schedule).splitlines()) <= 40, "schedule() should fit on a screen"


def test_registry_matches_config():
    assert tuple(SCHEDULERS) == minillm.config.ENGINES
