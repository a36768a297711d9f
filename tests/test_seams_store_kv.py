"""The ``store_kv_triton`` seam (chapter 3): a learner's Triton kernel writes every step's K/V.

Without a GPU the kernels run in Triton's interpreter on the CPU. Triton chooses interpreted
or compiled mode when ``@triton.jit`` runs (at import of the module that defines a kernel),
so TRITON_INTERPRET=1 is set before anything imports triton: by tests/conftest.py, as for
the exercise graders, and again below for a run of this file alone. With a GPU (and the
interpreter off) the same engine checks run on CUDA.
"""
from __future__ import annotations

import dataclasses
import importlib
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import pytest  # noqa: E402

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from minillm import SamplingParams, attention, model, seams  # noqa: E402
from minillm.attention import AttentionMetadata, cpu_attention_rows, triton_write_kv, write_kv  # noqa: E402
from minillm.config import EngineConfig  # noqa: E402
from minillm.engine import build_engine  # noqa: E402
from minillm.kernels.store_kv import store_kv_ref  # noqa: E402
from test_spec_engine import TINY, assert_all_free, run, tiny_engine, tiny_prompts, tiny_weights  # noqa: E402

import solutions.ch03_paged_attention as s03  # noqa: E402

INTERPRET = attention.triton_interprets()
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
_store_kv_module = importlib.import_module("minillm.kernels.store_kv")  # the package re-exports the function

pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and type(_store_kv_module._store_kv_kernel).__name__ != "InterpretedFunction",
    reason="triton was imported before TRITON_INTERPRET=1 was set; export TRITON_INTERPRET=1 first")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
TIGHT = dict(max_num_seqs=4, num_blocks=12, block_size=4, max_model_len=48)  # small enough to preempt


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """These tests time nothing: one thread keeps them quick on a shared machine."""


def schedule_of(engine):
    return [(tuple(s.request_ids), tuple(s.num_new_tokens), s.kv_reserved_bytes) for s in engine.step_records]


def counted(fn):
    def call(*args):
        call.calls += 1
        return fn(*args)

    call.calls = 0
    return call


# A wrong kernel: the keys go into both caches (the values are never stored).
@triton.jit
def _keys_twice_kernel(k_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_kh, H, D,
                       BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < H) & (d < D)
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        dst = slot * H * D + h * D + d
        tl.store(k_cache_ptr + dst, k, mask=mask)
        tl.store(v_cache_ptr + dst, k, mask=mask)


def keys_twice(k, v, k_cache, v_cache, slot_mapping):
    T, H, D = k.shape
    _keys_twice_kernel[(T,)](k, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), H, D,
                             BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D))


def ignores_padding(k, v, k_cache, v_cache, slot_mapping):
    """Wrong: a padding token's slot -1 is used as an index, so it lands in the cache's last slot."""
    H, D = k_cache.shape[2:]
    k_cache.view(-1, H, D)[slot_mapping.long()] = k
    v_cache.view(-1, H, D)[slot_mapping.long()] = v


def _tight_run(fn=None, backend="torch", prompts=None, params=GREEDY, **opts):
    eng = tiny_engine(device=DEVICE, attention_backend=backend, **(TIGHT | opts))
    prompts = tiny_prompts(6, seed=5) if prompts is None else prompts
    reqs = [eng.make_request(p, params) for p in prompts]
    with seams.plug(store_kv_triton=fn):
        got = [o.token_ids for o in eng.run(reqs)]
    return eng, reqs, got


def test_reference_store_keeps_tokens_schedule_and_cache_under_preemption():
    ref_eng, ref_reqs, ref = _tight_run()
    assert any(r.metrics.num_preemptions for r in ref_reqs), "the pool must be small enough to preempt"
    assert any(max(s.num_new_tokens) > 1 for s in ref_eng.step_records), "prefill steps"
    assert any(s.num_new_tokens and max(s.num_new_tokens) == 1 for s in ref_eng.step_records), "decode steps"
    mine = counted(s03.store_kv_triton)
    eng, _, got = _tight_run(mine)
    assert got == ref and schedule_of(eng) == schedule_of(ref_eng)
    assert mine.calls == len(eng.step_records) * TINY.num_layers, "every layer of every step writes through the seam"
    for (k, v), (k_ref, v_ref) in zip(eng.runner.kv_caches, ref_eng.runner.kv_caches):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref), "the same cache, bit for bit"
    assert_all_free(eng)
    assert seams.plugged("store_kv_triton") is None, "unplugged after the block"


def test_a_store_that_writes_keys_into_both_caches_is_stopped_at_its_first_write():
    """The engine reads back the rows a plugged store wrote before any query attends to them."""
    wrong = counted(keys_twice)
    with pytest.raises(seams.SeamContractError, match=r"store_kv_triton .*cache row slot_mapping\[t\] holds v\[t\]"):
        _tight_run(wrong)
    assert wrong.calls == 1


@pytest.mark.parametrize("write", [write_kv, triton_write_kv], ids=["write_kv", "triton_write_kv"])
def test_padding_tokens_and_other_slots_stay_untouched(write):
    """At the seam's call sites, with padding tokens (slot -1, as a padded CUDA-graph batch has):
    the reference answer writes exactly the real tokens' slots, and a store that ignores the
    padding is caught, because it writes a slot nobody owns."""
    g = torch.Generator().manual_seed(3)
    H, D, bs, nb, T = 2, 8, 4, 5, 6
    k, v = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g)
    slots = torch.tensor([7, -1, 0, 13, -1, 2])

    def store(fn):
        kc = torch.full((nb, bs, H, D), float("nan"), device=DEVICE)
        vc = torch.full((nb, bs, H, D), float("nan"), device=DEVICE)
        with seams.plug(store_kv_triton=fn):
            write(k.to(DEVICE), v.to(DEVICE), kc, vc, slots.to(DEVICE))
        return kc.cpu(), vc.cpu()

    want_k, want_v = torch.full((nb, bs, H, D), float("nan")), torch.full((nb, bs, H, D), float("nan"))
    store_kv_ref(k, v, want_k, want_v, slots, padded=True)
    mine = counted(s03.store_kv_triton)
    got_k, got_v = store(mine)
    assert mine.calls == 1
    torch.testing.assert_close(got_k, want_k, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(got_v, want_v, equal_nan=True, rtol=0, atol=0)
    bad_k, bad_v = store(ignores_padding)
    assert not torch.equal(bad_k.isnan(), want_k.isnan()), "the padding token wrote a slot nobody owns"


@pytest.mark.skipif(DEVICE != "cpu", reason="the cpu backend runs on CPU tensors (here: the interpreter is off)")
def test_the_cpu_backend_steps_aside_while_plugged(monkeypatch):
    """The cpu backend's fused layer ops write K/V in C++ and its attention is a C++ kernel:
    while a K/V store is plugged in, both step aside; the layer loop writes through the seam
    and ``torch_attention`` attends, so the tokens are the torch backend's."""
    used = {"layers": 0, "rows": 0}
    fused, rows_of = model.Llama._cpu_layers, attention.cpu_kernel.AttentionRows

    def spy_layers(self, *a):
        used["layers"] += 1
        return fused(self, *a)

    def spy_rows(*a):
        used["rows"] += 1
        return rows_of(*a)

    monkeypatch.setattr(model.Llama, "_cpu_layers", spy_layers)
    monkeypatch.setattr(attention.cpu_kernel, "AttentionRows", spy_rows)
    prompts, params = tiny_prompts(3, seed=2), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    _tight_run(backend="cpu", prompts=prompts, params=params)
    assert used["layers"] > 0 and used["rows"] > 0, "unplugged, the cpu backend runs its C++ layers and attention"

    used.update(layers=0, rows=0)
    _, _, torch_ref = _tight_run(backend="torch", prompts=prompts, params=params)
    mine = counted(s03.store_kv_triton)
    eng, _, got = _tight_run(mine, backend="cpu", prompts=prompts, params=params)
    assert used == {"layers": 0, "rows": 0}, "plugged, the C++ layer ops and attention step aside"
    assert mine.calls == len(eng.step_records) * TINY.num_layers
    assert got == torch_ref

    meta = AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.long),
                             block_tables=torch.zeros(1, 1, dtype=torch.int32),
                             query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                             context_lens=torch.ones(1, dtype=torch.int32), block_size=4, query_lens_list=[1],
                             context_lens_list=[1])
    with seams.plug(store_kv_triton=s03.store_kv_triton):
        assert cpu_attention_rows(meta, torch.float32) is None


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter runs the kernel on CPU tensors")
def test_the_triton_backend_writes_through_the_seam():
    # The Triton attention kernels take head_dim 16 and up: the tiny model with wider heads.
    cfg = dataclasses.replace(TINY, head_dim=16)
    weights = tiny_weights(cfg)
    prompts, params = tiny_prompts(2, seed=1), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    def go(fn=None):
        eng = build_engine(EngineConfig(engine="paged", device="cpu", dtype="float32", attention_backend="triton",
                                        **TIGHT), weights=weights, tokenizer=None, model_config=cfg)
        with seams.plug(store_kv_triton=fn):
            return eng, run(eng, prompts, params)

    ref_eng, ref = go()
    mine = counted(s03.store_kv_triton)
    eng, got = go(mine)
    assert got == ref and schedule_of(eng) == schedule_of(ref_eng)
    assert mine.calls == len(eng.step_records) * cfg.num_layers


def _one_token_write():
    k = torch.randn(1, 2, 8)
    caches = torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8)
    return k, k.clone(), *caches, torch.tensor([3])


def test_cpu_tensors_without_the_interpreter_are_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # triton reads it at each @triton.jit (and here)
    mine = counted(s03.store_kv_triton)
    with seams.plug(store_kv_triton=mine):
        with pytest.raises(ValueError, match="set TRITON_INTERPRET=1 before importing"):
            write_kv(*_one_token_write())
    assert mine.calls == 0, "the clear error comes before the launch"


def _copy_keys(k_ptr, k_cache_ptr, n):
    i = tl.arange(0, 16)
    tl.store(k_cache_ptr + i, tl.load(k_ptr + i, mask=i < n), mask=i < n)


@pytest.mark.skipif(torch.cuda.is_available(), reason="without a GPU a compiled-mode launch finds no driver")
def test_a_kernel_defined_before_the_interpreter_was_switched_on_is_a_clear_error():
    # What @triton.jit makes when TRITON_INTERPRET is unset at import: a compiled-mode kernel.
    from triton.runtime.jit import JITFunction

    compiled_mode = JITFunction(_copy_keys)

    def mine(k, v, k_cache, v_cache, slot_mapping):
        compiled_mode[(1,)](k, k_cache, k.numel())

    assert INTERPRET
    with seams.plug(store_kv_triton=mine):
        with pytest.raises(ValueError, match="defined before"):
            write_kv(*_one_token_write())
