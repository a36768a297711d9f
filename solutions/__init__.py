"""Reference answers to ``exercises/``, with the same module names and signatures.

Where an answer is a piece of ``minillm/``, the solution imports it from there and
names the place to read it, so the package stays the single source of truth.
"""
