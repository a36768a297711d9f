"""One engine step talks to the device twice: one upload of its inputs, one read of its tokens.

Every read of a device tensor from the host (``.tolist()``, ``.item()``, ``bool(t)``,
``int(t)``, ...) makes the host wait until the device has drained its queue; every small
host-built tensor is a separate copy. A decode step of a small model lasts about as long
as a few of those, so the step path packs its metadata into one upload
(``model_runner.build_batch``) and reads the sampled tokens back once.

This CPU-only machine has no device, so "would live on the device" means: any tensor the
step reads back, and any tensor the step creates from Python data (``torch.tensor``, a
list index) or copies to CUDA. A TorchFunctionMode sees every such call made by the step
path (calls inside triton's own interpreter, which emulates the kernel on the host, are
left out: on a GPU the launch reads nothing back).
"""
from __future__ import annotations

import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from minillm import SamplingParams
from minillm.config import EngineConfig, ModelConfig
from minillm.engine import build_engine

TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=256)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
          torch.Tensor.__index__, torch.Tensor.__int__, torch.Tensor.__float__}
_FROM_HOST = {torch.tensor, torch.as_tensor}


def _to_cuda(func, args, kwargs) -> bool:
    if func is torch.Tensor.cuda:
        return True
    if func is torch.Tensor.to:
        targets = list(args[1:]) + list(kwargs.values())
        return any(isinstance(a, (str, torch.device)) and torch.device(a).type == "cuda" for a in targets)
    return False


def _list_index(func, args) -> bool:
    """t[[1, 2]] or t[[1, 2]] = x builds an index tensor from host data."""
    if func not in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
        return False
    idx = args[1] if len(args) > 1 else None
    parts = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(p, list) for p in parts)


class HostTraffic(TorchFunctionMode):
    """Counts host reads of tensors and host-built tensors sent to the device."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.uploads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if not caller.startswith("triton"):
            name = getattr(func, "__name__", repr(func))
            if func in _READS:
                self.reads.append(name)
            elif func in _FROM_HOST or _to_cuda(func, args, kwargs) or _list_index(func, args):
                self.uploads.append(name)
        return func(*args, **kwargs)


def _engine(backend: str):
    cfg = EngineConfig(engine="paged", device="cpu", dtype="float32", attention_backend=backend,
                       max_model_len=128, block_size=8, max_num_seqs=4, enable_chunked_prefill=True)
    return build_engine(cfg, model_config=TINY, tokenizer=None)


def _counted_step(engine) -> tuple[HostTraffic, list[int]]:
    seen: list[int] = []
    execute = engine.runner.execute

    def spy(out):
        seen.extend(row.num_new_tokens for row in out.rows)
        return execute(out)

    engine.runner.execute = spy
    try:
        with HostTraffic() as traffic:
            engine.step()
    finally:
        engine.runner.execute = execute
    return traffic, seen


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=6,
                                                           ignore_eos=True)], ids=["greedy", "seeded"])
def test_one_read_and_one_upload_per_step(backend, params):
    if backend == "triton":
        pytest.importorskip("triton")
    engine = _engine(backend)
    for prompt in ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6, 7]):
        engine.add_request(prompt, params)
    engine.step()  # both prefills (not counted: the steps below are the ones measured)

    decode, rows = _counted_step(engine)
    assert rows == [1, 1], rows
    engine.add_request(list(range(20, 33)), params)
    mixed, rows = _counted_step(engine)
    assert sorted(rows) == [1, 1, 13], rows

    # Sampling at temperature > 0 reads its per-row parameters from the same upload.
    max_uploads = 1
    for kind, t in (("decode", decode), ("mixed", mixed)):
        assert len(t.reads) <= 1, f"{backend} {kind} step reads the device {len(t.reads)} times: {t.reads}"
        assert len(t.uploads) <= max_uploads, f"{backend} {kind} step uploads {len(t.uploads)} times: {t.uploads}"


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                    SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=12, ignore_eos=True)],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("method", ["ngram", "model"])
def test_speculative_step_one_read_and_one_upload_per_forward(method, params):
    """Verifying drafts (and drafting them with a model) keeps the budget per forward.

    The target's forward verifies every row's drafts with the parameters its upload
    carries and reads the emitted tokens once; a draft model's forwards are steps of
    their own, one upload and one read each.
    """
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1} if method == "ngram" \
        else {"method": "model", "draft_layers": [0], "num_speculative_tokens": 3}
    cfg = EngineConfig(engine="paged", device="cpu", dtype="float32", attention_backend="torch",
                       max_model_len=128, block_size=8, max_num_seqs=4, speculative=spec)
    engine = build_engine(cfg, model_config=TINY, tokenizer=None)
    for prompt in ([1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 5, 6, 5, 6, 5]):
        engine.add_request(prompt, params)
    engine.step()  # the prefills
    drafted = 0
    for _ in range(3):
        before = engine.speculator.stats.draft_forwards
        t, rows = _counted_step(engine)
        forwards = 1 + engine.speculator.stats.draft_forwards - before
        drafted += sum(n - 1 for n in rows)
        assert len(t.reads) <= forwards, f"{method} step: {forwards} forwards, {len(t.reads)} reads: {t.reads}"
        assert len(t.uploads) <= forwards, f"{method} step: {forwards} forwards, {len(t.uploads)} uploads: {t.uploads}"
    assert drafted > 0, "no step verified a draft: the test did not reach the verifier"
