"""The CPU attention kernel (minillm/kernels/cpu/attention.py: every query of a step a row) against its oracle.

* every decode row equals attention over exactly its own keys (the oracle, the kernels'
  ``paged_attention_ref``) and the torch backend, in float32 and bfloat16, for block sizes from 1 to
  one block per sequence (the contiguous engines), contexts across the kernel's chunk edges;
* steps that mix decode rows with prefills and chunks: the ``cpu`` backend equals the oracle;
* every query of a prefill, a chunk or a decode row is a kernel row of its own: a prompt's
  queries give the same bits attended at once, in chunks of any size, or one by one;
* a row's result does not depend on the other rows of the step (bit for bit), nor on the
  thread count;
* bad arguments are a ValueError before anything is read; no compiler is a clear error;
* candidate trees (``tree_start``/``tree_bits``): the nodes of a tree, rows of one sequence
  next to a plain decode row, see only their ancestors, as in the oracle, straddling block and
  chunk edges, also through ``layer_ops.ForwardOps``; any 64-bit mask (the sign bit too) is the
  oracle's; a wrong mask changes the output; bad tree arguments are a ValueError;
* engines on the ``cpu`` backend give the tokens of each request run alone.
"""
from __future__ import annotations

import random

import pytest
import torch

from minillm import placement
from minillm.attention import BACKENDS, AttentionMetadata, cpu_attention, cpu_attention_rows, torch_attention
from minillm.config import EngineConfig
from minillm.kernels.cpu import attention as kernel
from minillm.kernels.cpu import build, layer_ops
from minillm.kernels.paged_decode_attention import paged_attention_ref
from tests.test_step_cost import TINY, _meta

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler to build the CPU kernel")

CHUNK_EDGES = [1, 2, 63, 255, 256, 257, 511, 700]


def _oracle(q, k_cache, v_cache, meta, scale):
    """The attention oracle (``paged_attention_ref``: every row alone over exactly its keys, in float32)."""
    return paged_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens, scale)


def _case(qlens, ctxs, block_size, dtype, seed, Hq=9, Hkv=3, D=64):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    meta = _meta(qlens, ctxs, block_size, sum(-(-c // block_size) for c in ctxs) + 3, rng)
    nb = int(meta.block_tables.max()) + 4
    k_cache = torch.randn(nb, block_size, Hkv, D).to(dtype)
    v_cache = torch.randn(nb, block_size, Hkv, D).to(dtype)
    q = torch.randn(sum(qlens), Hq, D).to(dtype)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size", [1, 4, 16, 1024])
def test_decode_rows_equal_attention_over_their_own_keys(dtype, tol, block_size):
    ctxs = CHUNK_EDGES if block_size > 1 else [1, 2, 63, 257]
    q, k_cache, v_cache, meta = _case([1] * len(ctxs), ctxs, block_size, dtype, seed=block_size)
    got = cpu_attention(q, k_cache, v_cache, meta, 0.125)
    want = _oracle(q.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    assert got.dtype == dtype
    assert (got.float() - want).abs().max().item() < tol
    torch_got = torch_attention(q, k_cache, v_cache, meta, 0.125)
    assert (got.float() - torch_got.float()).abs().max().item() < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_steps_mixing_decodes_with_prefills_and_chunks_equal_the_torch_backend(dtype, tol):
    rng = random.Random(1)
    for trial in range(10):
        B = rng.randint(1, 8)
        qlens = [1 if rng.random() < 0.6 else rng.randint(2, 9) for _ in range(B)]
        ctxs = [max(n, rng.choice([rng.randint(1, 40), rng.randint(1, 600)])) for n in qlens]
        q, k_cache, v_cache, meta = _case(qlens, ctxs, rng.choice([2, 16]), dtype, seed=trial)
        got = cpu_attention(q, k_cache, v_cache, meta, 0.125)
        want = _oracle(q.float(), k_cache.float(), v_cache.float(), meta, 0.125)
        assert (got.float() - want).abs().max().item() < tol, (qlens, ctxs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_attends_to_the_same_bits_at_once_in_chunks_and_token_by_token(dtype):
    L = 300  # across the kernel's 256-key chunk edge
    q, k_cache, v_cache, meta = _case([L], [L], 16, dtype, seed=7)
    table = meta.block_tables

    def step(qlens, ctxs, b_rows):  # sequences that all read the prompt's blocks
        return AttentionMetadata(slot_mapping=torch.zeros(sum(qlens), dtype=torch.int64),
                                 block_tables=table[[0] * b_rows], query_start_loc=torch.tensor([0, *qlens]).cumsum(0),
                                 context_lens=torch.tensor(ctxs, dtype=torch.int32), block_size=16,
                                 query_lens_list=qlens, context_lens_list=ctxs)

    whole = cpu_attention(q, k_cache, v_cache, meta, 0.125)
    want = _oracle(q.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    assert (whole.float() - want).abs().max().item() < (2e-6 if dtype == torch.float32 else 2e-2)
    for cuts in ([1, 299], [100, 156, 44], [255, 2, 43], [7] * 42 + [6]):
        done = 0
        for n in cuts:
            got = cpu_attention(q[done:done + n], k_cache, v_cache, step([n], [done + n], 1), 0.125)
            assert torch.equal(got, whole[done:done + n]), (cuts, done)
            done += n
    # the last queries as decode rows of one step, next to a chunk of the same prompt
    got = cpu_attention(torch.cat([q[:50], q[297:]]), k_cache, v_cache,
                        step([50, 1, 1, 1], [50, 298, 299, 300], 4), 0.125)
    assert torch.equal(got, torch.cat([whole[:50], whole[297:]]))


def test_a_row_gives_the_same_bits_alone_in_any_batch_and_on_any_thread_count():
    ctxs = [5, 300, 700, 40, 257]
    q, k_cache, v_cache, meta = _case([1] * 5, ctxs, 16, torch.float32, seed=3)
    out = torch.empty_like(q)
    rows = torch.tensor([[b, b] for b in range(5)])
    kernel.attend_rows(q, k_cache, v_cache, meta.block_tables, meta.context_lens, rows, 0.125, out)
    threads = torch.get_num_threads()
    try:
        for n_threads, order in [(1, [2]), (2, [4, 0, 2]), (threads, [1, 3])]:
            torch.set_num_threads(n_threads)
            alone = torch.full_like(q, float("nan"))
            sel = torch.tensor([[b, b] for b in order])
            kernel.attend_rows(q, k_cache, v_cache, meta.block_tables, meta.context_lens, sel, 0.125, alone)
            for b in order:
                assert torch.equal(alone[b], out[b]), (n_threads, order, b)
    finally:
        torch.set_num_threads(threads)


def test_bad_arguments_are_refused_before_anything_is_read():
    q, k_cache, v_cache, meta = _case([1, 1], [20, 30], 4, torch.float32, seed=4)
    out = torch.empty_like(q)
    ok = torch.tensor([[0, 0], [1, 1]])
    args = (q, k_cache, v_cache, meta.block_tables, meta.context_lens)
    bad_table = meta.block_tables.clone()
    bad_table[1, 2] = k_cache.shape[0]  # a block past the cache's end
    cases = {
        "outside the cache": (q, k_cache, v_cache, bad_table, meta.context_lens, ok),
        "more blocks": (q, k_cache, v_cache, meta.block_tables, torch.tensor([20, 4000], dtype=torch.int32), ok),
        "outside block_tables": (*args, torch.tensor([[0, 0], [2, 1]])),
        "outside block_tables / q": (*args, torch.tensor([[0, 0], [1, 5]])),
        "no keys": (q, k_cache, v_cache, meta.block_tables, torch.tensor([20, 0], dtype=torch.int32), ok),
        "int32": (q, k_cache, v_cache, meta.block_tables.long(), meta.context_lens, ok),
        "one dtype": (q.double(), k_cache, v_cache, meta.block_tables, meta.context_lens, ok),
    }
    for what, a in cases.items():
        with pytest.raises(ValueError, match=what):
            kernel.attend_rows(*a, 0.125, out if a[0].dtype == out.dtype else out.double())
    with pytest.raises(ValueError, match="contiguous heads"):
        kernel.attend_rows(q.transpose(1, 2).contiguous().transpose(1, 2), *args[1:], ok, 0.125, out)


TREE_PARENTS = (-1, 0, 0, 0, 1, 1, 2, 4)  # node 0 is the root; node n >= 1 sits at key root_pos + n
TOLS = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


def _tree_bits(parents):
    """Each node's bit set over nodes 1 .. N (bit m - 1 for node m): its ancestors and itself."""
    bits = []
    for n in range(len(parents)):
        b, m = 0, n
        while m > 0:
            b |= 1 << (m - 1)
            m = parents[m]
        bits.append(b)
    return bits


def _tree_step(dtype, root_pos, block_size, seed):
    """One step: a decode row of sequence 0 (70 keys), then the root and the nodes of a tree of
    sequence 1 (its root at key root_pos) as queries of their own; the kernel's rows for them
    (``cpu_attention_rows``'s tables, the tree masks added) and the step's tree arguments [T]."""
    N = len(TREE_PARENTS)
    qlens, ctxs = [1, N], [70, root_pos + N]
    q, k_cache, v_cache, meta = _case(qlens, ctxs, block_size, dtype, seed=seed)
    tree_start = torch.tensor([70] + [root_pos + 1] * N, dtype=torch.int32)  # decode and root rows: nothing masked
    tree_bits = torch.tensor([0] + _tree_bits(TREE_PARENTS), dtype=torch.int64)
    bt, ctx, rows = cpu_attention_rows(meta, dtype).tensors  # one row per query, in token order
    return q, k_cache, v_cache, meta, (bt, ctx, rows), tree_start, tree_bits


def _tree_oracle(q, k_cache, v_cache, meta, tree_start, tree_bits):
    return paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta.block_tables, meta.query_start_loc,
                               meta.context_lens, 0.125, tree_start=tree_start, tree_bits=tree_bits)


@pytest.mark.parametrize("dtype", build.DTYPES)
@pytest.mark.parametrize("root_pos,block_size", [(27, 16), (250, 16), (13, 1), (5, 4)])
def test_tree_nodes_see_only_their_ancestors_as_in_the_oracle(dtype, root_pos, block_size):
    """The tree's keys straddle a block edge (key 32 at root 27, 256 at root 250: the kernel's
    chunk edge too); block size 1 puts every key in a block of its own."""
    q, k_cache, v_cache, meta, table, tree_start, tree_bits = _tree_step(dtype, root_pos, block_size, seed=root_pos)
    rows = kernel.AttentionRows(*table, tree_start, tree_bits)
    got = torch.full_like(q, float("nan"))
    rows(q, k_cache, v_cache, 0.125, got)
    want = _tree_oracle(q, k_cache, v_cache, meta, tree_start, tree_bits)
    assert (got.float() - want).abs().max().item() < TOLS[dtype]
    # the rows outside the tree's keys (the decode row, the root) give the bits they give without a
    # tree; node 1, which sees all its keys, the same numbers; every other node masks a key
    plain = cpu_attention(q, k_cache, v_cache, meta, 0.125)
    assert torch.equal(got[:2], plain[:2])
    assert (got[2].float() - plain[2].float()).abs().max().item() < TOLS[dtype]
    assert all(not torch.equal(got[t], plain[t]) for t in range(3, q.shape[0]))
    # the same rows bound once for a forward (model.Llama._cpu_layers): ForwardOps.attend
    T, Hq, D = q.shape
    h = torch.zeros(T, Hq * D, dtype=dtype)
    ops = layer_ops.ForwardOps(h, torch.ones(T, D, dtype=dtype), torch.zeros(T, D, dtype=dtype), meta, Hq,
                               [(k_cache, v_cache)], 32, rows)
    ops.q.copy_(q)
    assert torch.equal(ops.attend(0, 0.125), got)


@pytest.mark.parametrize("dtype", build.DTYPES)
def test_any_tree_mask_is_the_oracles_including_the_sign_bit(dtype):
    """Random 64-bit masks (negative int64s: bit 63 set) over trees of up to 64 nodes, some
    rows with tree_start past their keys (nothing masked) or before key 0, one with a chunk
    whose keys the mask all hides."""
    rng = random.Random(11)
    qlens, ctxs = [1, 5, 1, 3, 1], [64, 300, 9, 140, 600]
    q, k_cache, v_cache, meta = _case(qlens, ctxs, 16, dtype, seed=11)
    bt, ctx, rows = cpu_attention_rows(meta, dtype).tensors
    starts, bits = [], []
    for n in ctx.tolist():  # row i: token i, n keys
        start = rng.choice([n - 64, n - rng.randint(1, 63), n, n + 5, max(n - 64, -3)])
        b = rng.getrandbits(64) | (1 << (n - 1 - start) if 0 <= n - 1 - start < 64 else 0)  # the row sees itself
        starts.append(start)
        bits.append(b - (1 << 64) if b >= 1 << 63 else b)
    assert ctx[1] == 296
    starts[1], bits[1] = 240, 0xFFFF  # row 1 sees keys 0 .. 255 only: its second chunk (of 256 keys) is all hidden
    tree_start, tree_bits = torch.tensor(starts, dtype=torch.int32), torch.tensor(bits, dtype=torch.int64)
    assert (tree_bits < 0).any()
    got = torch.empty_like(q)
    kernel.attend_rows(q, k_cache, v_cache, bt, ctx, rows, 0.125, got, tree_start, tree_bits)
    want = _tree_oracle(q, k_cache, v_cache, meta, tree_start, tree_bits)
    assert (got.float() - want).abs().max().item() < TOLS[dtype]


def test_a_wrong_tree_mask_changes_the_output():
    q, k_cache, v_cache, meta, table, tree_start, tree_bits = _tree_step(torch.float32, 27, 16, seed=1)
    right = torch.empty_like(q)
    kernel.AttentionRows(*table, tree_start, tree_bits)(q, k_cache, v_cache, 0.125, right)
    for node, bit in [(7, 1), (4, 2), (3, 0), (7, 3)]:  # 7 also sees node 2, 4 sees 3, 3 sees 1; 7 not its 4
        wrong_bits = tree_bits.clone()
        wrong_bits[1 + node] ^= 1 << bit  # row 1 + node: the tree's rows follow the decode row
        wrong = torch.empty_like(q)
        kernel.AttentionRows(*table, tree_start, wrong_bits)(q, k_cache, v_cache, 0.125, wrong)
        changed = [t for t in range(q.shape[0]) if not torch.equal(wrong[t], right[t])]
        assert changed == [1 + node], (node, bit)
    later = tree_start.clone()
    later[1 + 5] += 1  # node 5's mask read one key later: it sees node 2, not itself
    wrong = torch.empty_like(q)
    kernel.AttentionRows(*table, later, tree_bits)(q, k_cache, v_cache, 0.125, wrong)
    assert not torch.equal(wrong[1 + 5], right[1 + 5])


def test_bad_tree_arguments_are_refused():
    q, k_cache, v_cache, meta, (bt, ctx, rows), tree_start, tree_bits = _tree_step(torch.float32, 27, 16, seed=2)
    out = torch.empty_like(q)
    cases = {
        "both or neither": [(tree_start, None), (None, tree_bits)],
        r"must be \[R\]": [(tree_start[1:], tree_bits[1:]), (tree_start, tree_bits[:, None]),
                            (tree_start[:, None], tree_bits)],
        "int32 and tree_bits int64": [(tree_start.long(), tree_bits), (tree_start, tree_bits.int())],
        "CPU tensors only": [(tree_start.to("meta"), tree_bits), (tree_start, tree_bits.to("meta"))],
    }
    for what, pairs in cases.items():
        for ts, tb in pairs:
            with pytest.raises(ValueError, match=what):
                kernel.AttentionRows(bt, ctx, rows, ts, tb)
    for start, bits in [(0, 0), (-64, -1), (1 - 70, 0)]:  # the decode row's 70 keys: none before its tree,
        hidden_start, hidden = tree_start.clone(), tree_bits.clone()  # and no bit of them set (or none under 64)
        hidden_start[0], hidden[0] = start, bits
        with pytest.raises(ValueError, match="hides all its keys"):
            kernel.attend_rows(q, k_cache, v_cache, bt, ctx, rows, 0.125, out, hidden_start, hidden)


def test_loading_the_kernel_leaves_the_process_float_state_alone():
    """Linked with -ffast-math, a library flushes subnormals to zero in the whole process on
    load (hypothesis then refuses to draw floats, and numbers everywhere change)."""
    build.library()
    assert 5e-324 * 1.0 > 0.0, "subnormal floats flushed to zero after loading the CPU kernel"
    tiny = torch.tensor(1e-40, dtype=torch.float32)
    assert (tiny * 1.0).item() > 0.0


def test_without_a_compiler_the_error_says_what_to_do(monkeypatch):
    monkeypatch.setattr(build, "_lib", None)
    monkeypatch.setattr(build, "_error", None)
    monkeypatch.setattr(build, "compiler", lambda: None)
    with pytest.raises(RuntimeError, match="attention_backend='torch'"):
        build.library()


def test_a_compiler_without_openmp_still_builds_a_kernel_that_gives_the_same_numbers(monkeypatch, tmp_path):
    q, k_cache, v_cache, meta = _case([1, 1, 1], [5, 300, 700], 16, torch.float32, seed=5)
    want = cpu_attention(q, k_cache, v_cache, meta, 0.125)
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "_lib", None)
    monkeypatch.setattr(build, "_error", None)
    # the first way fails as -fopenmp does on Apple's clang; the next one has no OpenMP
    monkeypatch.setattr(build, "ATTEMPTS", [(["-fno-such-option-minillm"], []), ([], [])])
    lib = build.library()
    meta.plan.clear()  # the step's rows hold the library they were built with: build them again, on this one
    assert cpu_attention_rows(meta, q.dtype).lib is lib
    torch.testing.assert_close(cpu_attention(q, k_cache, v_cache, meta, 0.125), want, rtol=1e-5, atol=1e-6)


def test_a_kernel_that_does_not_build_leaves_the_torch_backend_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "_lib", None)
    monkeypatch.setattr(build, "_error", None)
    monkeypatch.setattr(build, "ATTEMPTS", [(["-fno-such-option-minillm"], [])])
    with pytest.warns(UserWarning, match="did not build"):
        assert placement.resolve("cpu").attention_backend == "torch"
    with pytest.raises(RuntimeError, match="fno-such-option-minillm"):  # asked for by name: the compiler's words
        build.library()


def test_the_cpu_backend_is_the_default_on_a_cpu_with_a_compiler(monkeypatch):
    assert placement.resolve("cpu").attention_backend == "cpu"
    assert BACKENDS["cpu"][1] is cpu_attention
    monkeypatch.setattr(build, "compiler", lambda: None)
    assert placement.resolve("cpu").attention_backend == "torch"
    monkeypatch.setattr(placement, "cuda_available", lambda: True)
    with pytest.raises(ValueError, match="attention_backend='cpu' runs on the CPU"):
        placement.resolve("cuda", attention_backend="cpu")


@pytest.mark.parametrize("engine", ["continuous", "paged"])
def test_engines_on_the_cpu_backend_give_each_request_its_tokens_alone(engine):
    from minillm.engine import build_engine
    from minillm.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (3, 40, 9, 70, 1, 25)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    def run(ps, backend):
        cfg = EngineConfig(engine=engine, max_num_seqs=4, max_model_len=128, block_size=4, cpu_threads=None,
                           attention_backend=backend)
        eng = build_engine(cfg, model_config=TINY, tokenizer=None)
        return [o.token_ids for o in eng.run([eng.make_request(p, params) for p in ps])]

    together = run(prompts, "cpu")
    alone = [run([p], "cpu")[0] for p in prompts]
    assert together == alone
    assert together == run(prompts, "torch")
