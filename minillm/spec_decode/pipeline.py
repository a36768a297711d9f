"""The drafter on its own process: proposals stream to the engine through bounded queues.

``DraftProcess`` has the drafter interface (``propose``, ``rollback``, ``forget``,
``deterministic``, ``num_forwards``) and runs an n-gram or model drafter in a child
process (``torch.multiprocessing``, spawn, daemon). One engine step:

    engine process                                 draft process
    propose(t) --(key, new tokens, limit, hint)-->  reconcile each row's chain with the real
                                                    tokens; answer from the chain, drafting
               <--(drafts, q of sampled rows)-----  only what it lacks
    forward, verify, update, schedule t+1           prefetch: extend each chain, assuming the
    (the target's work)                             target accepts every draft and its bonus
                                                    token is the drafter's own next guess;
                                                    one forward at a time, stopping as soon
                                                    as a message waits
    propose(t+1) ------------------------------->   hit: the real new tokens are a prefix of
                                                    the chain, whose rest is the proposal

What overlaps: the prefetch runs while the engine runs the target forward, verifies,
updates and schedules. What does not: a miss (a rejected draft, or a bonus token other
than the guess) drafts on the critical path as the in-process drafter does, plus a round
trip; every step pays the round trip. A hit needs all k drafts accepted and the bonus
guessed: about alpha^(k+1) of the steps, so the pipeline pays only for a drafter that
agrees with the target most of the time, on cores the target does not need. So the
child prefetches for a row only while its last proposal was accepted in full: a wasted
prefetch still takes compute from the target. On a 2-core CPU the child's forwards take
a core from the target's (the engine's thread governor then drops to one thread):
``minillm.bench.draft_pipeline`` measures what is left.

A model drafter's chain is autoregressive: draft j is a function of the context, the
drafts before it and its position (``sampling.position_noise``), so any prefix of the
real tokens that matches the chain leaves the rest of the chain a valid proposal, the
one the in-process drafter computes (up to float rounding in a batch of another shape).
Prompt lookup is not autoregressive: its prefetch is one proposal for one assumed
context (``anchor``). Either way verification emits the target's own tokens, so greedy
and seeded outputs are the in-process drafter's, token for token. The q of a sampled
draft is the distribution the child drew it from, computed in the same forward; a greedy
row's q is the one-hot of its draft, rebuilt here (the very float32 one-hot
``compute_probs`` makes) instead of shipped. A learner's plugged seam lives in this
process only: the child drafts with the library's code.

Queues: ``QUEUE_SIZE`` (2) messages each way. The protocol is request-reply, so at most
one proposal is in flight; the second slot lets a ``forget`` travel without waiting (a
full queue waits: back-pressure, never an unbounded backlog). The child keeps its own
paged KV cache and block list, so the target's preemptions never reach it.

Cleanup: ``close()``; a ``weakref.finalize`` (garbage collection, interpreter exit); the
child exits when ``os.getppid()`` changes (its parent died); every wait has a timeout
and checks that the child is alive; an exception in the child comes back as its
traceback and is raised here as RuntimeError, after the child is stopped.
"""
from __future__ import annotations

import copy
import itertools
import os
import queue
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from ..request import Request
# drafters.build_drafter imports this module: the drafter classes travel in the recipe, no import back
Proposal = tuple[list[list[int]], list[torch.Tensor] | None]

QUEUE_SIZE = 2  # messages per direction
REPLY_TIMEOUT_S = 60.0  # longest wait for one step's drafts
START_TIMEOUT_S = 300.0  # spawn, imports, the model's weights, repacking
POLL_S = 0.2  # how often a waiting side checks the other is alive


# ---------------------------------------------------------------- the engine's side


@dataclass(slots=True)
class _Sent:
    key: int  # the request's id in the child
    num_sent: int  # tokens of all_token_ids the child has


class DraftProcess:
    """``inner`` (an ``NgramDrafter`` or a ``ModelDrafter``) drafting in a child process.

    ``num_speculative_tokens``: the config's k (the prefetch's guess at the next limit).
    ``threads``: torch threads in the child while it prefetches (alongside the target's
    forward); ``answer_threads`` while the engine waits for its drafts (default: ``threads``;
    on a small CPU more makes it worse: the two processes hand the cores back and forth
    every step, and each team's idle threads spin at the other's expense, measured). ``stats``:
    rows and tokens answered, how many came from the prefetch, and ``wait_s``, the time the
    engine waited for drafts.
    """

    def __init__(self, inner: Any, num_speculative_tokens: int, threads: int = 1, answer_threads: int | None = None,
                 reply_timeout_s: float = REPLY_TIMEOUT_S):
        import torch.multiprocessing as mp

        # The recipe names the drafter's class (pickled by reference): the child builds its own.
        if _is_ngram(inner):
            recipe: tuple = ("ngram", type(inner), dict(n_min=inner.proposer.n_min, n_max=inner.proposer.n_max))
            self.vocab_size, self.device = None, torch.device("cpu")
        elif _is_model(inner):
            runner = inner.runner
            model, repack = _portable(inner.model)
            recipe = ("model", type(inner), dict(model=model, repack=repack, num_blocks=runner.kv_caches[0][0].shape[0],
                                                 block_size=runner.block_size, device=str(runner.device),
                                                 dtype=runner.kv_caches[0][0].dtype))
            self.vocab_size, self.device = inner.model.cfg.vocab_size, runner.device
        else:
            raise ValueError(f"a draft process runs an NgramDrafter or a ModelDrafter, got {type(inner).__name__}")
        self.deterministic = inner.deterministic
        self.k = num_speculative_tokens
        self.reply_timeout_s = reply_timeout_s
        self.state: dict[Request, _Sent] = {}
        self.num_forwards = 0
        self.stats = dict(steps=0, rows=0, rows_prefetched=0, tokens=0, tokens_prefetched=0, prefetch_forwards=0,
                          wait_s=0.0)
        self._keys = itertools.count()
        self._step = itertools.count()
        self._forgotten: list[int] = []
        self._error: str | None = None
        ctx = mp.get_context("spawn")
        self._in, self._out = ctx.Queue(QUEUE_SIZE), ctx.Queue(QUEUE_SIZE)
        threads_ = (answer_threads or threads, threads)
        self.process = ctx.Process(target=_child_main, args=(recipe, self._in, self._out, os.getpid(), threads_),
                                   daemon=True, name="minillm-drafter")
        self._finalizer = weakref.finalize(self, _shutdown, self.process, self._in, self._out)
        try:
            self.process.start()  # pickles the recipe: the weights' storages move to shared memory, not copied again
        except BaseException:
            self._finalizer.detach()
            for q in (self._in, self._out):
                q.close()
            raise
        self._receive("ready", START_TIMEOUT_S)
        del recipe  # the child holds the weights now; ours (dense copies of packed layers) can go

    # -- the drafter interface ---------------------------------------------------------
    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> Proposal:
        rows = []
        for r, k in zip(requests, limits):
            sent = self.state.get(r)
            first = sent is None
            if first:
                sent = self.state[r] = _Sent(next(self._keys), 0)
            tokens = r.all_token_ids
            new, sent.num_sent = tokens[sent.num_sent:], len(tokens)
            rows.append((sent.key, new, k, self._hint(r, k), r.sampling_params if first else None,
                         r.seed if first else None))
        step = next(self._step)
        forgotten, self._forgotten = self._forgotten, []
        start = time.perf_counter()
        self._send(("propose", step, rows, forgotten))
        _, answered, drafts, probs, counters = self._receive("drafts", self.reply_timeout_s)
        self.stats["wait_s"] += time.perf_counter() - start
        if answered != step:
            self._fail(f"the draft process answered step {answered} to step {step}")
        self.num_forwards = counters.pop("forwards")
        self.stats.update(counters)
        if self.deterministic:
            return drafts, None
        return drafts, [self._probs(r, d, q) for r, d, q in zip(requests, drafts, probs)]

    def rollback(self, request: Request) -> None:
        """Nothing to do here: the child compares its chain with the real tokens next step."""

    def forget(self, request: Request) -> None:
        sent = self.state.pop(request, None)
        if sent is None or self._error is not None or not self.process.is_alive():
            return
        self._forgotten.append(sent.key)
        try:  # now if there is room, so the child stops prefetching for it; else with the next proposal
            self._in.put_nowait(("forget", self._forgotten))
            self._forgotten = []
        except queue.Full:
            pass

    def close(self) -> None:
        """Stop the child (idempotent); later proposals raise RuntimeError."""
        self._error = self._error or "the draft process was closed"
        self._finalizer()

    # -- helpers -------------------------------------------------------------------------
    def _hint(self, r: Request, limit: int) -> int:
        """The limit of this request's next step if it accepts all ``limit`` drafts now: how
        far the child prefetches (0: the request will be done, nothing to prefetch)."""
        k = self.k if r.num_speculative_tokens is None else r.num_speculative_tokens
        left = r.sampling_params.max_tokens - r.num_output_tokens - (limit + 1)
        return max(0, min(k, left - 1)) if limit > 0 else 0

    def _probs(self, r: Request, drafts: list[int], q: torch.Tensor | None) -> torch.Tensor:
        """[len(drafts), V]: what the child sampled from, or the one-hot of a greedy row's drafts."""
        if q is not None:
            return q.to(self.device)
        ids = torch.tensor(drafts, dtype=torch.long, device=self.device)
        return torch.zeros(len(drafts), self.vocab_size, device=self.device).scatter_(-1, ids[:, None], 1.0)

    def _send(self, msg: tuple) -> None:
        self._check()
        deadline = time.monotonic() + self.reply_timeout_s
        while True:
            try:
                self._in.put(msg, timeout=POLL_S)  # blocks while the queue is full: back-pressure
                return
            except queue.Full:
                self._check()
                if time.monotonic() > deadline:
                    self._fail(f"the draft process took no message for {self.reply_timeout_s:.0f} s")

    def _receive(self, kind: str, timeout_s: float) -> tuple:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self._out.get(timeout=POLL_S)
            except queue.Empty:
                self._check()
                if time.monotonic() > deadline:
                    self._fail(f"the draft process sent no {kind!r} in {timeout_s:.0f} s")
                continue
            if msg[0] == "error":
                self._fail(f"the draft process failed:\n{msg[1]}")
            if msg[0] != kind:
                self._fail(f"the draft process sent {msg[0]!r} where {kind!r} was due")
            return msg

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"{self._error}; build a new engine (or drafter) to draft again")
        if not self.process.is_alive():
            self._fail(f"the draft process {self.process.pid} died (exit code {self.process.exitcode})")

    def _fail(self, why: str):
        self._error = why
        self._finalizer()  # no orphan: stopped (and reaped) before the error propagates
        raise RuntimeError(why)


def _is_ngram(drafter: Any) -> bool:
    """A ``drafters.NgramDrafter``: prompt lookup, no model."""
    return hasattr(drafter, "proposer") and hasattr(drafter.proposer, "n_min")


def _is_model(drafter: Any) -> bool:
    """A ``drafters.ModelDrafter``: a causal LM with its own runner (paged KV cache)."""
    return hasattr(drafter, "runner") and hasattr(drafter, "model")


def _shutdown(process, in_q, out_q) -> None:
    """Ask the child to exit, then terminate, then kill; reap it; never wait on a queue's feeder."""
    if process.is_alive():
        try:
            in_q.put(("close",), timeout=0.5)
        except (queue.Full, ValueError, OSError):
            pass
        process.join(5.0)
    for stop in (process.terminate, process.kill):
        if process.is_alive():
            stop()
            process.join(2.0)
    for q in (in_q, out_q):
        q.cancel_join_thread()  # a feeder blocked on a dead reader's full pipe must not hang exit
        q.close()


def _portable(model: nn.Module) -> tuple[nn.Module, bool]:
    """A copy of ``model``'s module tree that pickles into shared memory: every plain tensor
    is the original's (shared, not copied); oneDNN-packed layers, which cannot travel, become
    nn.Linear over their dense weight. Returns (copy, whether the child must pack again)."""
    from ..model import PackedLinear

    packed = [False]

    def travel(m: nn.Module) -> nn.Module:
        if isinstance(m, PackedLinear):
            packed[0] = True
            with torch.device("meta"):
                lin = nn.Linear(m.in_features, m.out_features, bias=False)
            lin.weight = nn.Parameter(m.dense(), requires_grad=False)
            return lin
        c = copy.copy(m)
        c.__dict__ = dict(m.__dict__)
        c._modules = {k: None if v is None else travel(v) for k, v in m._modules.items()}
        c._parameters, c._buffers = dict(m._parameters), dict(m._buffers)
        return c

    out = travel(model)
    if getattr(model, "packed_head", None) is not None:
        packed[0] = True
        out.packed_head = None  # the child packs the head again from the embedding
    return out, packed[0]


# ---------------------------------------------------------------- the draft process


class _Shadow:
    """The child's copy of one request: what a drafter reads of a ``Request``."""

    def __init__(self, key: int, params: Any, seed: int | None, device: torch.device):
        self.request_id = key
        self.sampling_params, self.seed = params, seed
        self.generator = torch.Generator(device=device)  # scratch space, re-seeded for each position's noise
        self.metrics = _NoPreemptions  # the child's KV is its own: the target's preemptions never reset it
        self.base: list[int] = []  # the real tokens (prompt + output), as far as the engine has sent them
        self.chain: list[int] = []  # drafts that continue base, in order
        self.chain_q: list[torch.Tensor | None] = []  # the q each was drawn from (None: greedy, one-hot)
        self.anchor: int | None = None  # n-gram: chain[anchor:] is the lookup for base + chain[:anchor] ...
        self.guess_limit = 0  # ... asked for this many tokens
        self.valid = 0  # leading tokens of base + chain whose K/V the drafter's cache holds correctly
        self.block_ids: list[int] = []
        self.num_computed_tokens = 0  # what ``rollback`` cuts the drafter's cache to
        self.num_sent = 0  # drafts in the last proposal
        self.all_accepted = True  # ... which the target accepted in full (or none was sent yet)
        self.last_used = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.base + self.chain  # a new list: a drafter appends its drafts to what it reads

    @property
    def num_tokens(self) -> int:
        return len(self.base) + len(self.chain)


class _NoPreemptions:
    num_preemptions = 0


class _DraftWorker:
    """The child's work: answer a proposal from the chains, draft what they lack, prefetch."""

    def __init__(self, inner: Any, device: torch.device, block_size: int = 0, num_blocks: int = 0,
                 max_len: int | None = None):
        self.inner = inner
        self.chainable = _is_model(inner)  # drafts autoregressively (see the module docstring)
        self.device, self.block_size, self.max_len = device, block_size, max_len
        self.free = list(range(num_blocks))
        self.rows: dict[int, _Shadow] = {}
        self.prefetch: dict[_Shadow, tuple[int, int]] = {}  # row -> (drafts just sent, the next limit's guess)
        self.counters = dict(steps=0, rows=0, rows_prefetched=0, tokens=0, tokens_prefetched=0,
                             prefetch_forwards=0)
        self.tick = 0

    @classmethod
    def from_recipe(cls, recipe: tuple) -> "_DraftWorker":
        kind, drafter_class, opts = recipe
        if kind == "ngram":
            return cls(drafter_class(opts["n_min"], opts["n_max"]), torch.device("cpu"))
        model, device = opts["model"], torch.device(opts["device"])
        if opts["repack"]:
            model.pack_weights()
        if model.attention_backend == "cpu":
            from ..kernels.cpu import build

            build.library()  # load the C++ kernels now, not in the first step
        # Room for every request's prefetched chain beyond what the target reserves; short of
        # it, the least recently used rows' K/V is dropped (and recomputed if they come back).
        num_blocks = opts["num_blocks"] + max(16, opts["num_blocks"] // 4)
        inner = drafter_class(model, model.cfg, num_blocks, opts["block_size"], device, opts["dtype"])
        return cls(inner, device, opts["block_size"], num_blocks, model.cfg.max_position_embeddings)

    # -- a proposal ----------------------------------------------------------------------
    def answer(self, rows: list, forgotten: list[int]) -> tuple[list[list[int]], list, dict]:
        """rows: (key, new tokens, limit, hint, params, seed) -> (drafts, q of sampled rows, counters)."""
        self.forget(forgotten)
        self.prefetch.clear()
        self.tick += 1
        shadows, limits, ready = [], [], []
        for key, new, limit, _hint, params, seed in rows:
            sh = self.rows.get(key)
            if sh is None:
                sh = self.rows[key] = _Shadow(key, params, seed, self.device)
            sh.last_used = self.tick
            hit = self._reconcile(sh, new, limit)
            shadows.append(sh)
            limits.append(limit)
            # drafts already there: a chain's matching part, or a whole lookup (-1: none)
            ready.append(min(len(sh.chain), limit) if self.chainable else (len(sh.chain) if hit else -1))
        if self.chainable:  # the drafts each chain lacks
            todo = [(sh, k - len(sh.chain)) for sh, k in zip(shadows, limits) if len(sh.chain) < k]
        else:  # a lookup that missed, afresh
            todo = [(sh, k) for sh, k, n in zip(shadows, limits, ready) if k > 0 and n < 0]
        self._extend([sh for sh, _ in todo], [n for _, n in todo], protect=shadows)
        drafts = [sh.chain[:k] for sh, k in zip(shadows, limits)]
        probs = [None if self.inner.deterministic or sh.sampling_params.greedy or not d
                 else torch.stack(sh.chain_q[:len(d)]).cpu() for sh, d in zip(shadows, drafts)]
        c = self.counters
        c["steps"] += 1
        c["rows"] += sum(k > 0 for k in limits)
        c["rows_prefetched"] += sum(k > 0 and n >= len(d) for k, n, d in zip(limits, ready, drafts))
        c["tokens"] += sum(len(d) for d in drafts)
        c["tokens_prefetched"] += sum(max(0, min(n, len(d))) for n, d in zip(ready, drafts))
        for sh, d, (_, _, limit, hint, _, _) in zip(shadows, drafts, rows):
            if not self.chainable:  # past the proposal a lookup is no chain
                del sh.chain[len(d):], sh.chain_q[len(d):]
            sh.num_sent = len(d)
            if d and hint > 0 and sh.all_accepted:
                self.prefetch[sh] = (len(d), hint)
        return drafts, probs, dict(c, forwards=self.inner.num_forwards)

    def _reconcile(self, sh: _Shadow, new: list[int], limit: int) -> bool:
        """Append the real new tokens to ``sh.base`` and keep what of the chain still continues
        them. True when the prefetch holds this step's proposal (for a model: its first part)."""
        m, chain = len(new), sh.chain
        same = 0
        while same < min(m, len(chain)) and new[same] == chain[same]:
            same += 1
        sh.valid = min(sh.valid, len(sh.base) + same)  # the cache's K/V past the first difference is stale
        sh.all_accepted = same >= min(m, sh.num_sent)
        hit = same == m
        if not self.chainable:  # only the assumed context, and a lookup long enough (or cut by the context's end)
            p = len(chain) - m
            hit = hit and m == sh.anchor and (limit <= p or p < sh.guess_limit)
        sh.base.extend(new)
        if hit:
            del sh.chain[:m], sh.chain_q[:m]
        else:
            sh.chain, sh.chain_q = [], []
        sh.anchor = None
        return hit

    # -- prefetch between proposals -------------------------------------------------------
    def wants_prefetch(self) -> bool:
        return bool(self.prefetch)

    def prefetch_round(self) -> None:
        """One forward over every chain still short of its drafts + bonus guess + next limit
        (a model), or every guess at once (a lookup: no forward)."""
        before = self.inner.num_forwards
        if self.chainable:
            rows = [sh for sh, (n, hint) in self.prefetch.items() if len(sh.chain) < n + 1 + hint and self._room(sh)]
            self._extend(rows, [1] * len(rows), protect=list(self.prefetch), prefetch=True)
            if not rows:
                self.prefetch.clear()
        else:
            todo, self.prefetch = self.prefetch, {}
            rows = [sh for sh in todo if self._room(sh)]
            self._extend(rows, [1] * len(rows), protect=rows)  # the bonus guess: what the lookup copies next
            guessed = [sh for sh in rows if len(sh.chain) == todo[sh][0] + 1]
            for sh in guessed:
                sh.anchor, sh.guess_limit = len(sh.chain), todo[sh][1]
            self._extend(guessed, [sh.guess_limit for sh in guessed], protect=rows)
        self.counters["prefetch_forwards"] += self.inner.num_forwards - before

    def _room(self, sh: _Shadow) -> bool:
        """One more draft stays inside the model's positions."""
        return self.max_len is None or sh.num_tokens + 1 < self.max_len

    # -- drafting ----------------------------------------------------------------------------
    def _extend(self, rows: list[_Shadow], counts: list[int], protect: list[_Shadow], prefetch: bool = False) -> None:
        """Draft ``counts[i]`` more tokens after ``rows[i]``'s chain, all rows in one ``propose``."""
        todo = [(sh, n) for sh, n in zip(rows, counts) if n > 0]
        if self.block_size:  # K/V room in the child's own cache
            granted = [(sh, n) for sh, n in todo if self._grow(sh, sh.num_tokens + n, protect)]
            if len(granted) < len(todo) and not prefetch:
                raise RuntimeError(f"the draft process's KV cache cannot hold this step's drafts even after "
                                   f"dropping every other request's ({len(self.free)} blocks free)")
            todo = granted
        if not todo:
            return
        for sh, _ in todo:  # the drafter's K/V is right up to the first token that changed
            sh.num_computed_tokens = min(sh.valid, sh.num_tokens - 1)
            self.inner.rollback(sh)
        drafts, probs = self.inner.propose([sh for sh, _ in todo], [n for _, n in todo])
        for j, ((sh, _), d) in enumerate(zip(todo, drafts)):
            sampled = probs is not None and not sh.sampling_params.greedy
            sh.chain.extend(d)
            sh.chain_q.extend(probs[j][i] if sampled else None for i in range(len(d)))
            sh.valid = sh.num_tokens  # the drafter saw base + chain (its cache stops before the last draft)

    def _grow(self, sh: _Shadow, num_tokens: int, protect: list[_Shadow]) -> bool:
        """Blocks for ``num_tokens`` of ``sh``, dropping the least recently used other rows' K/V if short."""
        need = -(-num_tokens // self.block_size) - len(sh.block_ids)
        if need > len(self.free):
            kept = set(map(id, protect))
            for other in sorted(self.rows.values(), key=lambda s: s.last_used):
                if need <= len(self.free):
                    break
                if id(other) not in kept and other.block_ids:
                    self._drop_cache(other)
        if need > len(self.free):
            return False
        if need > 0:
            sh.block_ids.extend(self.free[-need:])
            del self.free[-need:]
        return True

    def _drop_cache(self, sh: _Shadow) -> None:
        """Give back ``sh``'s blocks: its tokens and chain stay, its K/V is recomputed when it returns."""
        self.inner.forget(sh)
        self.free.extend(sh.block_ids)
        sh.block_ids = []
        sh.valid = 0

    def forget(self, keys: list[int]) -> None:
        for key in keys:
            sh = self.rows.pop(key, None)
            if sh is not None:
                self._drop_cache(sh)
                self.prefetch.pop(sh, None)


def _use_threads(n: int) -> None:
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def _child_main(recipe: tuple, in_q, out_q, parent_pid: int, threads: tuple[int, int]) -> None:
    """The draft process: build the drafter, then answer and prefetch until told to close,
    until the parent is gone, or until an exception (sent back as its traceback)."""
    try:
        answer_threads, prefetch_threads = threads
        worker = _DraftWorker.from_recipe(recipe)
        del recipe
        out_q.put(("ready",))
        with torch.inference_mode():
            while os.getppid() == parent_pid:  # orphaned (the engine's process died): exit
                if worker.wants_prefetch():
                    try:
                        msg = in_q.get_nowait()
                    except queue.Empty:
                        _use_threads(prefetch_threads)  # the target computes meanwhile
                        worker.prefetch_round()
                        continue
                else:
                    try:
                        msg = in_q.get(timeout=POLL_S)
                    except queue.Empty:
                        continue
                if msg[0] == "close":
                    return
                if msg[0] == "forget":
                    worker.forget(msg[1])
                elif msg[0] == "propose":
                    _, step, rows, forgotten = msg
                    _use_threads(answer_threads)  # the engine waits: the cores are ours
                    drafts, probs, counters = worker.answer(rows, forgotten)
                    out_q.put(("drafts", step, drafts, probs, counters))
    except BaseException:  # noqa: BLE001 -- everything goes back to the engine, which raises it
        try:
            out_q.put(("error", traceback.format_exc()))
            out_q.close()
            out_q.join_thread()
        except Exception:
            pass


__all__ = ["DraftProcess", "QUEUE_SIZE", "REPLY_TIMEOUT_S"]
