"""Shared fixtures and the test tiers.

Tiers (design.md §4): plain CPU tests always run; Triton kernels run under the
interpreter when there is no GPU (TRITON_INTERPRET must be set before triton is first
imported, hence here, at import time); tests marked ``gpu`` skip without CUDA.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # exercises/ and solutions/ are importable from the root

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _torch_threads_as_before():
    """Each test starts with torch's thread count as the session began: a test that sets it
    (``--threads``, a thread governor) must not make every later test run on its setting."""
    from minillm.threads import keeps_torch_threads

    with keeps_torch_threads():
        yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test, then as before."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def real_llm():
    """The real SmolLM2 in fp32 on the CPU, simple engine, a short context (cheap KV)."""
    from minillm import LLM

    return LLM(device="cpu", dtype="float32", max_model_len=2048)


@pytest.fixture(scope="session")
def tokenizer(real_llm):
    return real_llm.tokenizer


@pytest.fixture(scope="session")
def hf_model():
    """transformers' LlamaForCausalLM loaded from the same GGUF (fp32): the oracle."""
    from minillm import loader

    return loader.load_hf_model(dtype=torch.float32)
