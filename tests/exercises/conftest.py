"""Make ``exercises``, ``solutions`` (repository root) and ``adapters`` (tests/) importable."""
import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[1]
for _path in (_TESTS, _TESTS.parent):  # the repository root ends up first: it holds the real packages
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
