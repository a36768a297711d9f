"""Grades exercises/ch10_beyond_one_device.py (or solutions/, with MINILLM_IMPL=solutions).

Oracles are written here (plain PyTorch), never taken from minillm, so the tests stay
meaningful for the solutions. ``parallel_mlp`` runs in a simulated world inside this
process: N threads, one per rank, each with its own shard, whose ``all_reduce`` meets the
others at a barrier, sums the N tensors and counts its calls. The last tests check the
grader itself (it fails a deliberately wrong MLP); they run with MINILLM_IMPL=solutions
and are skipped when grading exercises/. The whole file runs in about a second. Every
failure is one line: what was checked, what was expected, what came back.
"""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import adapters
from minillm.course import quiz

pytestmark = pytest.mark.exercises

CHAPTER = "ch10_beyond_one_device"
shard_linear = adapters.function(CHAPTER, "shard_linear")
parallel_mlp = adapters.function(CHAPTER, "parallel_mlp")
allreduce_bytes_per_step = adapters.function(CHAPTER, "allreduce_bytes_per_step")
quiz_answers = adapters.function(CHAPTER, "quiz_answers")


def _weights(n: int, k: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.1).to(dtype)


# ---------------------------------------------------------------- shard_linear


def _oracle_shard(w: torch.Tensor, sizes: list[int], rank: int, parallel: str) -> torch.Tensor:
    start = sum(sizes[:rank])
    return w[start:start + sizes[rank]] if parallel == "column" else w[:, start:start + sizes[rank]]


def _check_shard(w: torch.Tensor, sizes: list[int], rank: int, parallel: str) -> torch.Tensor:
    what = f"shard_linear(weight {list(w.shape)} {str(w.dtype).removeprefix('torch.')}, sizes={sizes}, " \
           f"rank={rank}, parallel={parallel!r})"
    want = _oracle_shard(w, sizes, rank, parallel)
    got = shard_linear(w, sizes, rank, parallel)
    adapters.expect(adapters.shape_of(got), tuple(want.shape), f"{what}: shape")
    adapters.expect(got.dtype, w.dtype, f"{what}: dtype")
    if not torch.equal(got, want):
        wrong = (got != want)
        i, j = divmod(int(wrong.flatten().int().argmax()), want.shape[1])
        start = sum(sizes[:rank])
        src = f"weight[{start + i}, {j}]" if parallel == "column" else f"weight[{i}, {start + j}]"
        pytest.fail(f"{what}: element [{i}, {j}]: expected {float(want[i, j]):.6g} ({src}), got "
                    f"{float(got[i, j]):.6g}; {int(wrong.sum())} of {want.numel()} elements differ", pytrace=False)
    adapters.expect_that(got.is_contiguous(), f"{what}: is_contiguous()", "True (a contiguous copy)", "False")
    own = got.untyped_storage().nbytes()
    adapters.expect_that(own == got.numel() * got.element_size(), f"{what}: bytes of storage the slice keeps",
                         f"{got.numel() * got.element_size()} (a copy of its own elements)",
                         f"{own} (a view that keeps the whole matrix alive: .clone() it)")
    return got


def test_shard_linear_example():
    """The docstring's example: column-parallel keeps rows start .. start + sizes[rank], row-parallel those columns."""
    w = torch.arange(12.0).reshape(4, 3)
    adapters.expect(shard_linear(w, [3, 1], 1, "column").tolist(), [[9.0, 10.0, 11.0]],
                    "shard_linear(arange(12).reshape(4, 3), sizes=[3, 1], rank=1, 'column') (row 3)")
    adapters.expect(shard_linear(w, [2, 1], 0, "row").tolist(), [[0.0, 1.0], [3.0, 4.0], [6.0, 7.0], [9.0, 10.0]],
                    "shard_linear(arange(12).reshape(4, 3), sizes=[2, 1], rank=0, 'row') (columns 0 and 1)")


@pytest.mark.parametrize("parallel", ["column", "row"])
@pytest.mark.parametrize("sizes", [[24], [12, 12], [8, 8, 8], [10, 6, 8], [6, 6, 6, 6]])
def test_shard_linear_slices(parallel, sizes):
    """Contract: exactly the elements of the rank's piece, in order, as a contiguous copy with storage of its own."""
    w = _weights(24, 24, seed=len(sizes) * 10 + sizes[0])
    for rank in range(len(sizes)):
        _check_shard(w, sizes, rank, parallel)


@pytest.mark.parametrize("parallel", ["column", "row"])
def test_shard_linear_pieces_make_the_weight(parallel):
    """Contract: the pieces of all ranks put back together (torch.cat along the split dimension) are the weight."""
    w = _weights(20, 36, seed=7)
    dim, n = (0, 20) if parallel == "column" else (1, 36)
    sizes = [n // 2 + 1, n - n // 2 - 1]
    back = torch.cat([shard_linear(w, sizes, r, parallel) for r in range(2)], dim=dim)
    adapters.expect_that(torch.equal(back, w), f"torch.cat of shard_linear(weight [20, 36], sizes={sizes}, rank, "
                                               f"{parallel!r}) over ranks 0 and 1, along dim {dim}",
                         "the weight itself", "another tensor" if back.shape == w.shape else
                         f"shape {tuple(back.shape)}")


def test_shard_linear_smollm_kv_heads_on_two_ranks():
    """Contract: the pieces need not be equal: SmolLM2-135M's 3 KV heads of 64 (k_proj [192, 576]) on 2 ranks
    are 2 heads and 1, in bfloat16 (the slice keeps the dtype)."""
    k_proj = _weights(192, 576, seed=135, dtype=torch.bfloat16)
    _check_shard(k_proj, [128, 64], 0, "column")
    _check_shard(k_proj, [128, 64], 1, "column")
    o_proj = _weights(576, 576, seed=136, dtype=torch.bfloat16)  # 9 query heads: 6 and 3
    _check_shard(o_proj, [384, 192], 1, "row")


def test_shard_linear_an_empty_piece():
    """Contract: the pieces need not be equal, and a piece may be 0."""
    w = _weights(8, 4, seed=2)
    _check_shard(w, [6, 0, 2], 1, "column")
    _check_shard(w, [6, 0, 2], 2, "column")


def test_shard_linear_rejects_bad_input():
    """Contract: ValueError for parallel not "column" or "row", a weight not 2-D, sizes not summing to the split
    dimension, a size < 0, or a rank outside [0, len(sizes))."""
    w = _weights(8, 6, seed=3)
    cases = [
        ((w, [4, 4], 0, "col"), "parallel='col' (only 'column' or 'row')"),
        ((w, [4, 4], 0, "rows"), "parallel='rows' (only 'column' or 'row')"),
        ((w, [4, 3], 0, "column"), "sizes=[4, 3] for 8 rows (they add up to 7)"),
        ((w, [4, 4], 0, "row"), "sizes=[4, 4], 'row', for 6 columns"),
        ((w, [10, -2], 0, "column"), "sizes=[10, -2] (a size < 0, though they add up to 8)"),
        ((w, [4, 4], 2, "column"), "rank=2 with 2 pieces"),
        ((w, [4, 4], -1, "column"), "rank=-1"),
        ((w[0], [3, 3], 0, "row"), "a 1-D weight [6]"),
        ((w.reshape(2, 4, 6), [1, 1], 0, "column"), "a 3-D weight [2, 4, 6]"),
    ]
    for args, why in cases:
        adapters.expect_raises(ValueError, f"shard_linear(weight [8, 6], ...) with {why}", shard_linear, *args)


# ---------------------------------------------------------------- parallel_mlp (a simulated world of N ranks)


class _Rendezvous:
    """A reusable barrier for N threads that any thread can break: a rank that fails, or
    that returns while the others still wait for it, breaks it, so no test hangs. A thread
    already released from a round returns normally even if the barrier breaks afterwards."""

    def __init__(self, n: int):
        self.n, self.count, self.round, self.broken = n, 0, 0, False
        self.cond = threading.Condition()

    def wait(self) -> None:
        with self.cond:
            if self.broken:
                raise threading.BrokenBarrierError
            this_round = self.round
            self.count += 1
            if self.count == self.n:
                self.count, self.round = 0, self.round + 1
                self.cond.notify_all()
                return
            while self.round == this_round:
                if self.broken or not self.cond.wait(timeout=30):
                    self.broken = True
                    self.cond.notify_all()
                    raise threading.BrokenBarrierError

    def abort(self) -> None:
        with self.cond:
            self.broken = True
            self.cond.notify_all()


class _World:
    """N ranks as N threads; ``all_reduce(t)`` sums the N ranks' tensors (in rank order).

    ``mode="new"`` returns a new tensor and leaves ``t`` as it was; ``mode="in_place"`` sums
    into ``t`` and returns it (as torch.distributed does to its argument)."""

    def __init__(self, n: int, what: str, mode: str = "new"):
        self.n, self.what, self.mode = n, what, mode
        self.barrier = _Rendezvous(n)
        self.posted: list[torch.Tensor | None] = [None] * n
        self.calls = [0] * n

    def all_reduce_for(self, rank: int):
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            self.calls[rank] += 1
            if not isinstance(t, torch.Tensor):
                pytest.fail(f"{self.what}: all_reduce's argument on rank {rank}: expected a tensor, got "
                            f"{type(t).__name__}", pytrace=False)
            self.posted[rank] = t.detach().clone()
            self.barrier.wait()  # every rank has posted
            shapes = [tuple(p.shape) for p in self.posted]
            if len(set(shapes)) > 1:
                pytest.fail(f"{self.what}: all_reduce call {self.calls[rank]}: expected the same shape from every "
                            f"rank (all-reduce once, after the down projection), got shapes {shapes}",
                            pytrace=False)
            total = self.posted[0].clone()
            for other in self.posted[1:]:
                total += other
            self.barrier.wait()  # every rank has read before anyone posts again
            if self.mode == "in_place":
                t.copy_(total)
                return t
            return total

        return all_reduce

    def run(self, fn, args_of_rank) -> list:
        results: list = [None] * self.n
        errors: list[BaseException | None] = [None] * self.n

        def work(rank: int) -> None:
            try:
                results[rank] = fn(*args_of_rank(rank), self.all_reduce_for(rank))
            except BaseException as e:  # noqa: BLE001 -- pytest.fail's exception too: re-raised below
                errors[rank] = e
            # Done (or failed): a rank still waiting in all_reduce now waits for a call that never comes.
            self.barrier.abort()

        threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        firsts = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
        if firsts:
            raise firsts[0]
        if any(e is not None for e in errors) or any(t.is_alive() for t in threads):
            pytest.fail(f"{self.what}: all_reduce calls per rank: expected the same number on every rank (one), "
                        f"got {self.calls}", pytrace=False)
        return results


def _mlp_case(T: int, hidden: int, sizes: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    inter = sum(sizes)
    x = torch.randn(T, hidden, generator=g)
    wg = torch.randn(inter, hidden, generator=g) * hidden ** -0.5
    wu = torch.randn(inter, hidden, generator=g) * hidden ** -0.5
    wd = torch.randn(hidden, inter, generator=g) * inter ** -0.5
    want = F.linear(F.silu(x @ wg.T) * (x @ wu.T), wd)
    shards = []
    for r in range(len(sizes)):
        s, e = sum(sizes[:r]), sum(sizes[:r + 1])
        shards.append((torch.cat([wg[s:e], wu[s:e]]).contiguous(), wd[:, s:e].contiguous()))
    return x, shards, want


def _grade_parallel_mlp(fn, T: int, hidden: int, sizes: list[int], mode: str = "new", seed: int = 0) -> None:
    """Run ``fn`` on len(sizes) simulated ranks and compare every rank with the unsharded MLP."""
    __tracebackhide__ = True
    n = len(sizes)
    x, shards, want = _mlp_case(T, hidden, sizes, seed)
    what = f"parallel_mlp on {n} rank{'s' if n > 1 else ''} (x [{T}, {hidden}], intermediate pieces {sizes}" \
           f"{', all_reduce in place' if mode == 'in_place' else ''})"
    world = _World(n, what, mode)
    results = world.run(fn, lambda r: (x.clone(), shards[r][0], shards[r][1]))
    adapters.expect(world.calls, [1] * n, f"{what}: all_reduce calls per rank (one, after the down projection)")
    for rank, got in enumerate(results):
        adapters.expect_close(got, want, f"{what}: rank {rank}'s output against the unsharded MLP",
                              atol=1e-5, rtol=1e-5,
                              note="F.linear(F.silu(x @ Wg.T) * (x @ Wu.T), Wd): return what all_reduce returns")


@pytest.mark.parametrize("sizes", [[48], [24, 24], [16, 16, 16], [20, 16, 12], [12, 12, 12, 12]],
                         ids=["N1", "N2", "N3", "N3-uneven", "N4"])
@pytest.mark.parametrize("T", [1, 7])
def test_parallel_mlp_matches_the_unsharded_mlp(sizes, T):
    """Contract: exactly one all_reduce, after the down projection; every rank's result equals the unsharded MLP."""
    _grade_parallel_mlp(parallel_mlp, T, 32, sizes, seed=T * 10 + len(sizes))


@pytest.mark.parametrize("sizes", [[24, 24], [16, 16, 16, 16]], ids=["N2", "N4"])
def test_parallel_mlp_with_an_in_place_all_reduce(sizes):
    """Contract: all_reduce may sum its argument in place and return it: use what it returns."""
    _grade_parallel_mlp(parallel_mlp, 5, 32, sizes, mode="in_place", seed=3)


def test_parallel_mlp_smollm_shapes_on_two_ranks():
    """Contract: every rank's result equals the unsharded MLP, at SmolLM2-135M's shapes (hidden 576,
    intermediate 1536), a decode step of 8 tokens on 2 ranks."""
    _grade_parallel_mlp(parallel_mlp, 8, 576, [768, 768], seed=135)


# ---------------------------------------------------------------- the grader fails wrong answers

_graded_against_solutions = pytest.mark.skipif(
    adapters.impl() != "solutions", reason="checks the grader itself, not your code (MINILLM_IMPL=solutions)")


def _all_reduce_after_gate_up(x, gate_up, down, all_reduce):  # wrong: sums different ranks' features
    gate, up = all_reduce(F.linear(x, gate_up)).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def _all_reduce_twice(x, gate_up, down, all_reduce):  # right answer, then one all-reduce too many
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    out = all_reduce(F.linear(F.silu(gate) * up, down))
    all_reduce(torch.zeros_like(out))
    return out


def _ignores_the_sum(x, gate_up, down, all_reduce):  # calls all_reduce, returns its own partial sum
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    partial = F.linear(F.silu(gate) * up, down)
    all_reduce(partial)
    return partial


@_graded_against_solutions
@pytest.mark.parametrize("wrong,expected", [
    (_all_reduce_after_gate_up, "output against the unsharded MLP"),
    (_all_reduce_twice, "all_reduce calls per rank"),
    (_ignores_the_sum, "output against the unsharded MLP"),
], ids=["all-reduce-after-gate-up", "two-all-reduces", "ignores-the-returned-sum"])
def test_the_grader_fails_a_wrong_parallel_mlp(wrong, expected):
    """The grader itself: a misplaced, doubled or ignored all-reduce fails the N-rank check."""
    with pytest.raises(pytest.fail.Exception) as failed:
        _grade_parallel_mlp(wrong, 5, 32, [16, 16], seed=1)
    assert expected in str(failed.value), str(failed.value)


@_graded_against_solutions
def test_the_grader_passes_the_wrong_placement_on_one_rank_only():
    """On one rank every placement is the plain MLP: the N >= 2 cases are what catch it."""
    _grade_parallel_mlp(_all_reduce_after_gate_up, 5, 32, [32], seed=1)


# ---------------------------------------------------------------- allreduce_bytes_per_step


@pytest.mark.parametrize("layers,hidden,tokens,dtype_bytes", [
    (30, 576, 8, 4),      # the docstring's example: SmolLM2-135M, a decode step of 8 tokens, float32
    (30, 576, 1, 2),      # one token, bfloat16
    (30, 576, 512, 2),    # a prefill chunk of 512 tokens
    (80, 8192, 64, 2),    # a 70B-class model
    (2, 16, 3, 1),
    (4, 128, 5, 8),
    (0, 576, 8, 4),       # no layers, no all-reduces
    (30, 576, 0, 4),      # no tokens this step
])
def test_allreduce_bytes_per_step(layers, hidden, tokens, dtype_bytes):
    """Contract: 2 * num_layers * hidden_size * num_tokens * dtype_bytes, as an int; zero tokens or layers: 0 bytes."""
    want = 2 * layers * hidden * tokens * dtype_bytes
    got = allreduce_bytes_per_step(layers, hidden, tokens, dtype_bytes)
    adapters.expect_that(type(got) is int and got == want,
                         f"allreduce_bytes_per_step(num_layers={layers}, hidden_size={hidden}, "
                         f"num_tokens={tokens}, dtype_bytes={dtype_bytes})",
                         f"{want} (an int: 2 all-reduces a layer x {tokens} x {hidden} elements x {dtype_bytes} bytes)",
                         f"{got!r} ({type(got).__name__})")


def test_allreduce_bytes_per_step_rejects_bad_input():
    """Contract: ValueError for an argument that is negative or not an int (a float or a bool), or dtype_bytes
    not one of 1, 2, 4, 8."""
    good = dict(num_layers=30, hidden_size=576, num_tokens=8, dtype_bytes=4)
    bad = [("num_layers", -1), ("hidden_size", -576), ("num_tokens", -8), ("num_tokens", 8.0),
           ("hidden_size", 576.0), ("num_layers", "30"), ("num_tokens", True), ("dtype_bytes", True),
           ("dtype_bytes", 3), ("dtype_bytes", 0), ("dtype_bytes", 16), ("dtype_bytes", 4.0), ("num_layers", None)]
    for name, value in bad:
        args = {**good, name: value}
        adapters.expect_raises(ValueError, f"allreduce_bytes_per_step({name}={value!r}, the others valid)",
                               allreduce_bytes_per_step, **args)


# ---------------------------------------------------------------- quiz


@pytest.mark.parametrize("qid", [q.qid for q in quiz.questions(CHAPTER)])
def test_quiz(qid):
    """The chapter's questions: each answer as the question asks for it."""
    answers = quiz_answers()
    assert isinstance(answers, dict), f"quiz_answers() must return a dict of answers, got {type(answers).__name__}"
    ok, why = quiz.check(CHAPTER, qid, answers.get(qid))
    assert ok, why
