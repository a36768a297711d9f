"""Exercises, one module per chapter: ``chNN_topic.py``.

Every function here is a stub that raises ``NotImplementedError``. Replace the
``raise`` with your implementation, then grade your work from the repository root
with ``make grade`` (or ``make grade CHAPTER=ch00``). See README.md in this folder.
"""
