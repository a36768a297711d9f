"""bench --engine llamacpp without llama.cpp: the one-line error, --dummy-weights refused, and the
whole path (job file, llamacpp_peer.py, result parsing, same_tokens_as) through a stand-in
Python whose ``llama_cpp`` is a fake."""
import importlib.util
import json
import stat
import sys
import textwrap

import pytest

from minillm.bench import compare, llamacpp_runner

SMALL = ["--workload", "uniform", "--num-requests", "2", "--workload-param", "prompt_len=8",
         "--workload-param", "output_len=3", "--max-num-seqs", "1", "--no-progress", "--threads", "1"]

FAKE_LLAMA_CPP = '''\
"""A stand-in for llama_cpp: Llama answers tokens from $FAKE_LLAMA_TOKENS (else 7s) and logs what it sees."""
import json
import os

__version__ = "fake"


def _log(**entry):
    with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
        f.write(json.dumps(entry) + "\\n")


class Llama:
    def __init__(self, model_path, **kwargs):
        _log(init=dict(model_path=model_path, **kwargs))
        self._n_ctx, self.n_batch = kwargs["n_ctx"], min(kwargs["n_ctx"], kwargs.get("n_batch", 512))
        self.n_tokens = 0
        self._logits_all = kwargs.get("logits_all", False)
        self.scores = []
        self._given = json.loads(os.environ.get("FAKE_LLAMA_TOKENS", "[]"))
        self._prompts = -1  # the warm-up prompt comes first

    def n_ctx(self):
        return self._n_ctx

    def reset(self):
        self.n_tokens = 0

    def eval(self, tokens):
        if self.n_tokens == 0:  # a new sequence: the KV cache was reset
            self._prompts += 1
            self._sampled = 0
            _log(prompt=list(tokens))
        if self.n_tokens == 0:
            self.scores = []
        if self._logits_all:  # a vocabulary of 8: logit v of token t is (3 t + v) % 8
            self.scores = self.scores + [[float((3 * t + v) % 8) for v in range(8)] for t in tokens]
        self.n_tokens += len(tokens)
        assert self.n_tokens <= self._n_ctx

    def sample(self, top_k=40, temp=0.8, **kwargs):
        assert temp == 0.0 and top_k == 1 and kwargs.get("repeat_penalty", 1.0) == 1.0
        i, k = self._prompts - 1, self._sampled
        self._sampled += 1
        return self._given[i][k] if 0 <= i < len(self._given) else 7
'''


def _fake_python(tmp_path):
    """A Python whose ``llama_cpp`` is FAKE_LLAMA_CPP: answers bench's probe, runs the real peer script."""
    lib = tmp_path / "fakelib" / "llama_cpp"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text(FAKE_LLAMA_CPP)
    path = tmp_path / "fake-python"
    path.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import runpy, shutil, sys
        if sys.argv[1] == "-c":  # bench asks whether llama_cpp can be imported
            sys.exit(0)
        shutil.copy(sys.argv[2], {str(tmp_path / "job-seen.json")!r})
        sys.path.insert(0, {str(lib.parent)!r})
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")
        """))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _no_run(monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the benchmark ran although it should have stopped before")

    monkeypatch.setattr(compare, "run_benchmark", must_not_run)


def test_no_llamacpp_is_one_line_and_status_2(tmp_path, monkeypatch, capsys):
    from minillm.__main__ import main

    monkeypatch.setenv("MINILLM_LLAMACPP_PYTHON", str(tmp_path / "no-such-python"))
    _no_run(monkeypatch)
    with pytest.raises(SystemExit) as e:
        main(["bench", "--engine", "continuous,llamacpp", *SMALL])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "make peer-llamacpp" in lines[0] and "MINILLM_LLAMACPP_PYTHON" in lines[0], err
    assert out == ""


def test_find_llamacpp_python_order(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    monkeypatch.setattr(llamacpp_runner, "repo_root", lambda: tmp_path)
    monkeypatch.delenv("MINILLM_LLAMACPP_PYTHON", raising=False)
    with pytest.raises(llamacpp_runner.LlamaCppNotFound, match="llama.cpp is not installed: run `make peer-llamacpp`"):
        llamacpp_runner.find_llamacpp_python()
    local = tmp_path / ".venv-llamacpp" / "bin" / "python"
    local.parent.mkdir(parents=True)
    local.symlink_to(_fake_python(tmp_path))
    assert llamacpp_runner.find_llamacpp_python() == str(local)
    other = tmp_path / "other-python"
    other.symlink_to(tmp_path / "fake-python")
    monkeypatch.setenv("MINILLM_LLAMACPP_PYTHON", str(other))  # the variable comes first
    assert llamacpp_runner.find_llamacpp_python() == str(other)


def test_dummy_weights_are_refused(tmp_path, monkeypatch, capsys):
    from minillm.bench.workload import make_workload

    monkeypatch.setenv("MINILLM_LLAMACPP_PYTHON", str(_fake_python(tmp_path)))
    _no_run(monkeypatch)
    with pytest.raises(SystemExit) as e:
        compare.main(["--engine", "continuous,llamacpp", "--dummy-weights", *SMALL])
    assert e.value.code == 2 and "llama.cpp reads the real GGUF only" in capsys.readouterr().err
    monkeypatch.undo()
    wl = make_workload("uniform", 2, 0, None, prompt_len=8, output_len=3)
    with pytest.raises(ValueError, match="--dummy-weights cannot run with llamacpp"):
        compare.run_benchmark(["llamacpp"], wl, max_num_seqs=1, dummy_weights=True, progress=False)


def test_llamacpp_result_through_a_fake_llama_cpp(tmp_path, monkeypatch, capsys):
    """The job llama.cpp gets, what the peer script feeds it, and what bench makes of its answer."""
    from minillm import loader

    monkeypatch.setenv("MINILLM_LLAMACPP_PYTHON", str(_fake_python(tmp_path)))
    log = tmp_path / "llama-log.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    from minillm.bench.workload import make_workload

    # llama.cpp "agrees" on the first request only: its tokens there are the continuous engine's.
    wl = make_workload("uniform", 2, 0, loader.load_tokenizer(), prompt_len=8, output_len=3)
    cont = compare.run_benchmark(["continuous"], wl, max_num_seqs=1, progress=False, threads=1)[0]
    monkeypatch.setenv("FAKE_LLAMA_TOKENS", json.dumps([cont.output_token_ids[0], [1, 2, 3]]))
    out = tmp_path / "b.json"
    assert compare.main(["--engine", "continuous,llamacpp", *SMALL, "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    ll, c = got["llamacpp"], got["continuous"]
    assert ll["same_tokens_as"] == {"engine": "continuous", "fraction": 0.5, "first_difference": [None, 0]}
    assert c["same_tokens_as"]["fraction"] == 1.0
    assert ll["dtype"] == "Q4_1/Q8_0 (gguf)" and ll["llama_cpp_version"] == "fake"
    assert ll["output_tokens"] == 6 and ll["num_requests"] == 2 and ll["max_num_seqs"] == 1
    assert ll["max_concurrency"] == 1 and ll["forward_passes"] == 2 * 3  # a prompt, then two decodes
    assert ll["ttft_s"]["p50"] > 0 and ll["wall_s"] > 0 and ll["slot_utilization"] is None
    assert ll["kv_reserved_bytes"] == c["max_model_len"] * loader.read_config().kv_bytes_per_token(2)
    # The job: the same prompt token ids and max_tokens, the threads, the model's GGUF.
    job = json.loads((tmp_path / "job-seen.json").read_text())
    assert [r["prompt_token_ids"] for r in job["requests"]] == [r.prompt_token_ids for r in wl]
    assert [r["max_tokens"] for r in job["requests"]] == [3, 3]
    assert job["model"] == str(loader.find_gguf()) and job["n_threads"] == 1
    assert job["n_ctx"] == c["max_model_len"]
    # What the peer asked of llama_cpp: the settings, then each prompt from an empty KV cache.
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    init = seen[0]["init"]
    assert init["model_path"] == job["model"] and init["n_threads"] == 1 and init["n_ctx"] == job["n_ctx"]
    assert init["logits_all"] is False and init["verbose"] is False
    assert [s["prompt"] for s in seen[1:]] == [[1, 2, 3, 4]] + [r.prompt_token_ids for r in wl]
    assert "llamacpp" in capsys.readouterr().out  # the table has its row


def test_peer_serves_one_request_at_a_time_in_arrival_order():
    """llamacpp_peer.run: requests in order of arrival, the next waits for the one before; times per token."""
    spec = importlib.util.spec_from_file_location("llamacpp_peer", llamacpp_runner.LLAMACPP_PEER)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)  # stdlib only at import: llama_cpp is imported inside main()

    class FakeLlama:  # each eval takes one tick of the clock; sample answers the cache length
        n_batch = 4

        def __init__(self, clock):
            self.clock, self.n_tokens, self.resets = clock, 0, 0

        def reset(self):
            self.n_tokens, self.resets = 0, self.resets + 1

        def eval(self, tokens):
            self.n_tokens += len(tokens)
            self.clock[0] += 1.0

        def sample(self, **kwargs):
            return self.n_tokens

    clock = [0.0]
    slept = []

    def sleep(s):
        slept.append(s)
        clock[0] += s

    llm = FakeLlama(clock)
    reqs = [{"prompt_token_ids": [5] * 6, "max_tokens": 2, "arrival_time": 10.0},
            {"prompt_token_ids": [7], "max_tokens": 3, "arrival_time": 0.0}]
    start, end, recs, passes = peer.run(llm, reqs, now=lambda: clock[0], sleep=sleep)
    assert start == 0.0 and slept == [7.0]  # the second request ran first (t 0-3), the first waited until 10
    assert recs[1]["token_ids"] == [1, 2, 3] and recs[1]["token_times"] == [1.0, 2.0, 3.0]
    assert recs[0]["token_ids"] == [6, 7] and recs[0]["token_times"] == [11.0, 12.0]
    assert recs[0]["arrival_time"] == 10.0 and recs[0]["finish_time"] == end == 12.0
    assert llm.resets == 2 and passes == 3 + 2 + 1  # a 6-token prompt is two batches of 4


# --- Parallel slots (llama.cpp's server with -np): the scheduling loop, then the whole path. ---

def _load_peer():
    spec = importlib.util.spec_from_file_location("llamacpp_peer", llamacpp_runner.LLAMACPP_PEER)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    return peer


def _greedy_by_sum(prompt, max_tokens):
    """The stand-ins' 'model': the next token is the sum of the sequence's tokens so far, mod 1000."""
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(sum(seq) % 1000)
        seq.append(out[-1])
    return out


class FakeSlots:
    """serve's batches: checks each sequence's positions continue its KV cells, answers by _greedy_by_sum,
    one clock tick per step."""

    def __init__(self, clock, n_slots, n_batch):
        self.clock, self.n_slots, self.n_batch = clock, n_slots, n_batch
        self.kv, self.calls, self.removed = {}, [], []

    def step(self, entries):
        self.calls.append([(seq, list(toks), pos, wants) for seq, toks, pos, wants in entries])
        assert sum(len(e[1]) for e in entries) <= self.n_batch
        assert len({e[0] for e in entries}) == len(entries)  # one run of tokens per sequence
        out = []
        for seq, toks, pos, wants in entries:
            assert 0 <= seq < self.n_slots
            cells = self.kv.setdefault(seq, [])
            assert pos == len(cells), "positions continue the sequence's cells"
            cells.extend(toks)
            if wants:
                out.append(sum(cells) % 1000)
        self.clock[0] += 1.0
        return out

    def remove(self, seq):
        self.removed.append(seq)
        del self.kv[seq]


class SumLlama:  # run()'s Llama with the same 'model' as FakeSlots
    n_batch = 8

    def __init__(self, clock):
        self.clock, self.cells = clock, []

    def reset(self):
        self.cells = []

    def eval(self, tokens):
        self.cells += list(tokens)
        self.clock[0] += 1.0

    def sample(self, **kwargs):
        return sum(self.cells) % 1000


def test_serve_slots_fcfs_chunks_removal_and_times():
    """Two slots, a batch of 8 tokens: arrival order, decodes before prompt tokens, a prompt split
    across steps, finished sequences removed and their slot reused, a sleep until the next arrival."""
    peer = _load_peer()
    clock, slept = [0.0], []

    def sleep(s):
        slept.append(s)
        clock[0] += s

    reqs = [{"prompt_token_ids": [5], "max_tokens": 1, "arrival_time": 100.0},   # alone, after a pause
            {"prompt_token_ids": [1, 2, 3], "max_tokens": 2, "arrival_time": 0.0},
            {"prompt_token_ids": list(range(10, 20)), "max_tokens": 1, "arrival_time": 0.0},
            {"prompt_token_ids": [7, 8], "max_tokens": 3, "arrival_time": 0.5}]   # waits for a free slot
    slots = FakeSlots(clock, 2, 8)
    start, end, recs, steps = peer.serve(slots, reqs, 2, 8, now=lambda: clock[0], sleep=sleep)
    assert slots.calls == [
        [(0, [1, 2, 3], 0, True), (1, list(range(10, 15)), 0, False)],  # the second prompt's first 5 tokens
        [(0, [6], 3, True), (1, list(range(15, 20)), 5, True)],  # a decode first, then the rest
        [(0, [7, 8], 0, True)],  # request 3 arrived at 0.5 and takes the lowest free slot
        [(0, [15], 2, True)], [(0, [30], 3, True)],
        [(0, [5], 0, True)]]  # request 0, at t=100 after a sleep: nothing ran in between
    assert slots.removed == [0, 1, 0, 0] and slots.kv == {}
    assert slept == [95.0] and start == 0.0 and end == 101.0
    for i, r in enumerate(reqs):
        assert recs[i]["token_ids"] == _greedy_by_sum(r["prompt_token_ids"], r["max_tokens"])
        assert recs[i]["arrival_time"] == r["arrival_time"]
    assert recs[1]["token_times"] == [1.0, 2.0] and recs[2]["token_times"] == [2.0]  # stamped at the step's end
    assert recs[3]["token_times"] == [3.0, 4.0, 5.0] and recs[3]["scheduled_time"] == 2.0
    assert recs[0]["token_times"] == [101.0] and recs[0]["finish_time"] == 101.0 and recs[0]["slot"] == 0
    assert [r["slot"] for r in recs[1:]] == [0, 1, 0]
    assert [(s["requests"], s["tokens"], s["sampled"], s["running"], s["waiting"]) for s in steps] == [
        ([1, 2], [3, 5], 1, 2, 1), ([1, 2], [1, 5], 2, 0, 1), ([3], [2], 1, 1, 0), ([3], [1], 1, 1, 0),
        ([3], [1], 1, 0, 0), ([0], [1], 1, 0, 0)]
    assert [(s["start"], s["end"]) for s in steps][:3] == [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]


def test_serve_one_slot_is_batch_one_and_more_slots_change_no_token():
    """One slot serves as run() does (same tokens, same times); eight slots give the same tokens
    (the stand-in is batch-invariant; llama.cpp's kernels need not be) in fewer steps."""
    peer = _load_peer()
    reqs = [{"prompt_token_ids": [i + 1] * (3 + i % 4), "max_tokens": 2 + (i * 5) % 7, "arrival_time": 0.0}
            for i in range(10)]
    clock = [0.0]
    _, end1, ran, passes = peer.run(SumLlama(clock), reqs, now=lambda: clock[0])
    clock = [0.0]
    _, end_s, served, steps = peer.serve(FakeSlots(clock, 1, 8), reqs, 1, 8, now=lambda: clock[0])
    assert [r["token_ids"] for r in served] == [r["token_ids"] for r in ran]
    assert [r["token_times"] for r in served] == [r["token_times"] for r in ran] and end_s == end1
    assert len(steps) == passes
    clock = [0.0]
    slots = FakeSlots(clock, 8, 64)
    _, end8, par, steps8 = peer.serve(slots, reqs, 8, 64, now=lambda: clock[0])
    assert [r["token_ids"] for r in par] == [r["token_ids"] for r in ran]
    assert max(len(s["requests"]) for s in steps8) == 8  # the first step: every slot's prompt
    assert len(steps8) < len(steps) and end8 < end_s and sorted(slots.removed) == sorted(r["slot"] for r in par)
    # first come, first served: the two requests left out of the first batch go in arrival order
    assert sorted(range(10), key=lambda i: par[i]["scheduled_time"])[8:] == [8, 9]


def test_serve_refuses_a_batch_smaller_than_the_slots():
    peer = _load_peer()
    with pytest.raises(ValueError, match="n_slots <= n_batch"):
        peer.serve(FakeSlots([0.0], 4, 2), [], 4, 2)


def test_llamacpp_parallel_setting(monkeypatch):
    monkeypatch.delenv("MINILLM_LLAMACPP_PARALLEL", raising=False)
    assert llamacpp_runner.llamacpp_parallel() == 1 and llamacpp_runner.llamacpp_parallel(8) == 8
    monkeypatch.setenv("MINILLM_LLAMACPP_PARALLEL", "4")
    assert llamacpp_runner.llamacpp_parallel() == 4 and llamacpp_runner.llamacpp_parallel(2) == 2
    monkeypatch.setenv("MINILLM_LLAMACPP_PARALLEL", "many")
    with pytest.raises(ValueError, match="MINILLM_LLAMACPP_PARALLEL=many"):
        llamacpp_runner.llamacpp_parallel()
    with pytest.raises(ValueError, match=">= 1"):
        llamacpp_runner.llamacpp_parallel(0)


FAKE_LLAMA_CPP_LOW_LEVEL = '''

# The low-level calls of parallel slots: a context whose "model" answers by the sum of each
# sequence's cells mod 1000; it checks positions, sequence ids and the KV size, and logs.
import ctypes

N_VOCAB = 1000


class _Params:
    def __init__(self, **kw):
        self.__dict__.update(kw)

    @classmethod
    def from_buffer_copy(cls, other):
        return cls(**vars(other))


_Llama_init = Llama.__init__


def _init(self, model_path, **kwargs):
    _Llama_init(self, model_path, **kwargs)
    self.model = "model:" + model_path
    self.context_params = _Params(n_ctx=kwargs["n_ctx"], n_batch=kwargs["n_batch"], n_ubatch=kwargs["n_ubatch"],
                                  n_seq_max=1, kv_unified=False, n_threads=kwargs["n_threads"])


Llama.__init__ = _init


class _Ctx:
    def __init__(self, params):
        self.params, self.kv, self.out = params, {}, {}


def llama_init_from_model(model, params):
    _log(context={k: getattr(params, k) for k in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max", "kv_unified")})
    return _Ctx(params)


def llama_get_memory(ctx):
    return ctx


def llama_model_get_vocab(model):
    return model


def llama_vocab_n_tokens(vocab):
    return N_VOCAB


def llama_n_seq_max(ctx):
    return ctx.params.n_seq_max


def llama_n_ctx(ctx):
    return ctx.params.n_ctx


class _Batch:
    def __init__(self, n):
        self.token, self.pos, self.n_seq_id, self.logits = [0] * n, [0] * n, [0] * n, [0] * n
        self.seq_id, self.n_tokens = [[0] for _ in range(n)], 0


def llama_batch_init(n_tokens, embd, n_seq_max):
    assert embd == 0 and n_seq_max == 1
    _log(batch_init=n_tokens)
    return _Batch(n_tokens)


def llama_decode(ctx, b):
    n = b.n_tokens
    _log(decode=[[b.seq_id[i][0], b.token[i], b.pos[i], bool(b.logits[i])] for i in range(n)])
    assert 0 < n <= ctx.params.n_batch
    ctx.out = {}
    for i in range(n):
        seq = b.seq_id[i][0]
        cells = ctx.kv.setdefault(seq, [])
        assert 0 <= seq < ctx.params.n_seq_max and b.n_seq_id[i] == 1 and b.pos[i] == len(cells)
        cells.append(b.token[i])
        if b.logits[i]:
            ctx.out[i] = sum(cells) % N_VOCAB
    assert sum(len(c) for c in ctx.kv.values()) <= ctx.params.n_ctx
    return 0


def llama_get_logits_ith(ctx, i):
    ctx.logits = (ctypes.c_float * N_VOCAB)()
    ctx.logits[ctx.out[i]] = 1.0
    return ctypes.cast(ctx.logits, ctypes.POINTER(ctypes.c_float))


def llama_memory_seq_rm(mem, seq_id, p0, p1):
    assert p0 == -1 and p1 == -1
    _log(seq_rm=seq_id)
    mem.kv.pop(seq_id, None)
    return True


def llama_batch_free(batch):
    _log(batch_free=True)


def llama_free(ctx):
    _log(free=True)
'''


def test_parallel_slots_through_a_fake_llama_cpp(tmp_path, monkeypatch):
    """run_llamacpp with 2 slots ($MINILLM_LLAMACPP_PARALLEL): the job, the peer's context and batches
    (through LlamaSlots and a stand-in of the low-level calls), and the per-step numbers of the result."""
    from minillm import loader
    from minillm.bench.summary import summarize
    from minillm.bench.workload import make_workload

    python = _fake_python(tmp_path)
    lib = tmp_path / "fakelib" / "llama_cpp" / "__init__.py"
    lib.write_text(lib.read_text() + FAKE_LLAMA_CPP_LOW_LEVEL)
    log = tmp_path / "llama-log.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    monkeypatch.setenv("MINILLM_LLAMACPP_PARALLEL", "2")
    wl = make_workload("skewed", 5, 0, None, short_tokens=3, long_tokens=9, long_every=5, prompt_len=6)
    res = llamacpp_runner.run_llamacpp(wl, gguf_path=loader.find_gguf(), threads=1, n_ctx=64, python=str(python))
    assert res.output_token_ids == [_greedy_by_sum(r.prompt_token_ids, r.max_tokens) for r in wl]
    job = json.loads((tmp_path / "job-seen.json").read_text())
    assert job["parallel"] == 2 and job["kv_unified"] is True and job["n_ctx"] == 64
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    ctx = next(s["context"] for s in seen if "context" in s)
    assert ctx == {"n_ctx": 128, "n_batch": 64, "n_ubatch": 64, "n_seq_max": 2, "kv_unified": True}
    decodes = [s["decode"] for s in seen if "decode" in s]
    removed = [s["seq_rm"] for s in seen if "seq_rm" in s]
    assert len(removed) == 2 + len(wl)  # the warm-up's two sequences, then every request
    assert seen[-2:] == [{"batch_free": True}, {"free": True}]
    warm = 2  # the warm-up: both 4-token prompts in one batch, then a decode of both
    assert decodes[0] == [[0, t, p, p == 3] for p, t in enumerate([1, 2, 3, 4])] + \
        [[1, t, p, p == 3] for p, t in enumerate([1, 2, 3, 4])]
    assert all(len({row[0] for row in d}) <= 2 for d in decodes)
    s = summarize(res)
    assert s["forward_passes"] == len(decodes) - warm == len(res.steps)
    assert s["max_concurrency"] == 2 and s["llamacpp_parallel"] == 2 and res.num_slots == 2
    assert 0 < s["slot_utilization"] <= 1 and 1 < s["mean_running"] <= 2 and s["decode_stall_steps"] == 0
    assert s["output_tokens"] == sum(r.max_tokens for r in wl) and s["ttft_s"]["p50"] > 0
    assert s["kv_reserved_bytes"] == 128 * loader.read_config().kv_bytes_per_token(2)
    assert s["kv_used_bytes_peak"] is None and s["kv_waste_fraction"] is None
    # first come, first served: with every request there at t=0, slots are taken in workload order
    sched = [m.first_scheduled_time for m in res.metrics]
    assert sched == sorted(sched) and res.metrics[0].queue_wait >= 0


def test_llamacpp_logits_through_a_fake_llama_cpp(tmp_path, monkeypatch):
    """Logits mode: each sequence fed whole from an empty cache with logits_all, one .npy each, read back."""
    import torch

    from minillm import loader

    fake = _fake_python(tmp_path)
    log = tmp_path / "llama-log.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    seqs = [[1, 2, 3], [4, 5]]
    got = llamacpp_runner.llamacpp_logits(seqs, gguf_path=loader.find_gguf(), threads=1, python=str(fake))
    want = [torch.tensor([[float((3 * t + v) % 8) for v in range(8)] for t in s]) for s in seqs]
    assert len(got) == 2 and all(torch.equal(g, w) for g, w in zip(got, want))
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert entries[0]["init"]["logits_all"] is True and entries[0]["init"]["n_ctx"] == 3
    assert [e["prompt"] for e in entries if "prompt" in e] == seqs  # no warm-up, no BOS, each from empty
    with pytest.raises(ValueError, match="no empty one"):
        llamacpp_runner.llamacpp_logits([[1], []], gguf_path=loader.find_gguf(), threads=1, python=str(fake))


def test_llamacpp_parallel_flag_reaches_the_runner(tmp_path, monkeypatch, capsys):
    """--llamacpp-parallel P is what run_llamacpp gets (else the variable's value); a bad P is a usage error."""
    monkeypatch.setenv("MINILLM_LLAMACPP_PYTHON", str(_fake_python(tmp_path)))
    seen = []

    class Stop(Exception):
        pass

    def fake_run(workload, **kwargs):
        seen.append(kwargs["parallel"])
        raise Stop

    monkeypatch.setattr(compare, "run_llamacpp", fake_run)
    for argv, env, want in ((["--llamacpp-parallel", "4"], "2", 4), ([], "3", 3), ([], None, 1)):
        if env is None:
            monkeypatch.delenv("MINILLM_LLAMACPP_PARALLEL", raising=False)
        else:
            monkeypatch.setenv("MINILLM_LLAMACPP_PARALLEL", env)
        with pytest.raises(Stop):
            compare.main(["--engine", "llamacpp", *SMALL, *argv])
        assert seen[-1] == want
    with pytest.raises(SystemExit) as e:
        compare.main(["--engine", "llamacpp", *SMALL, "--llamacpp-parallel", "0"])
    assert e.value.code == 2 and "parallel slots must be >= 1" in capsys.readouterr().err
