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
