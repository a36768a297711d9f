"""minillm: a small, readable LLM serving engine, built chapter by chapter."""
from .config import EngineConfig, ModelConfig
from .engine import LLM, LLMEngine, RequestOutput
from .sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "EngineConfig", "ModelConfig"]
__version__ = "0.1.0"
