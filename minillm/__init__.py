"""minillm: a small, readable LLM serving engine, built chapter by chapter.

``from minillm import LLM, SamplingParams`` is the whole public face. Nothing is imported
until a name is used (PEP 562), so ``import minillm.scheduler`` or ``minillm.seams`` stays
plain Python and does not load torch or the model.
"""
import importlib

_EXPORTS = {
    "LLM": "engine",
    "LLMEngine": "engine",
    "RequestOutput": "engine",
    "SamplingParams": "sampling_params",
    "EngineConfig": "config",
    "ModelConfig": "config",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
