"""What opening an engine costs: a KV cache that is not written up front, no compiler import.

``LLM()`` used to take ~22 s here before its first token (plus ~15 s reading the GGUF's
config and tokenizer, now cached on disk: tests/test_loader.py), most of it writing
zeros into a 3 GB CPU KV cache that a learner's requests barely use.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from minillm.config import ModelConfig
from minillm.model_runner import allocate_kv_cache, untouched_zeros


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_untouched_zeros_are_zeros_of_the_asked_shape_and_dtype(dtype):
    x = untouched_zeros((3, 5, 2, 4), dtype=dtype)
    assert (x.shape, x.dtype, x.device.type) == ((3, 5, 2, 4), dtype, "cpu")
    assert x.is_contiguous() and x.data_ptr() % 64 == 0
    assert torch.equal(x, torch.zeros(3, 5, 2, 4, dtype=dtype))
    x[1, 2] = 7  # writable, and a write lands where a torch.zeros tensor's would
    ref = torch.zeros(3, 5, 2, 4, dtype=dtype)
    ref[1, 2] = 7
    assert torch.equal(x, ref)
    with pytest.raises(ValueError, match="CPU"):
        untouched_zeros((2,), device="meta")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads resident memory from /proc")
def test_a_cpu_kv_cache_takes_memory_only_where_tokens_are_written():
    cfg = ModelConfig(num_layers=4)  # SmolLM2's heads: 768 bytes of K per token per layer
    before = _resident_bytes()
    caches = allocate_kv_cache(cfg, num_blocks=8, block_size=8192, device=torch.device("cpu"),
                               dtype=torch.float32)  # 8 x 50 MB: what 4 layers of the default cache hold
    allocated = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in caches)
    assert allocated == 8 * 50_331_648
    grown = _resident_bytes() - before
    assert grown < allocated // 20, f"allocating a {allocated >> 20} MB cache made {grown >> 20} MB resident"
    for k, v in caches:  # one 300-token prompt in block 0 of every layer
        k[0, :300] = 1.0
        v[0, :300] = 1.0
    grown = _resident_bytes() - before
    assert grown < allocated // 10, f"writing 300 tokens made {grown >> 20} MB of the cache resident"
    assert all(float(k[1:].abs().sum()) == 0.0 and float(k[0, 300:].abs().sum()) == 0.0 for k, _ in caches)


def test_building_an_engine_does_not_import_the_compiler():
    # A normal_ init on the meta device imports torch._dynamo (~2 s); the model's weights
    # all come from the checkpoint, so building it must not pay that.
    code = textwrap.dedent("""
        import sys
        from minillm import LLM
        from minillm.config import ModelConfig
        LLM(engine="paged", dummy_weights=True, max_model_len=256)
        print("compiler imported:", "torch._dynamo" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "compiler imported: False" in out.stdout, out.stdout + out.stderr[-2000:]
