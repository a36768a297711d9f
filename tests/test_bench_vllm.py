"""bench --dtype, and bench --engine vllm without vLLM: the one-line error, and the whole
path (job file, result parsing, fields, same_tokens_as) through a stand-in for vLLM's Python."""
import json
import stat
import sys
import textwrap

import pytest

from minillm.bench import compare, vllm_runner

TINY = ["--dummy-weights", "--workload", "uniform", "--num-requests", "2", "--workload-param", "prompt_len=8",
        "--workload-param", "output_len=3", "--max-num-seqs", "2", "--no-progress", "--threads", "1"]


def _no_run(monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the benchmark ran although vLLM is missing")

    monkeypatch.setattr(compare, "run_benchmark", must_not_run)


def test_no_vllm_is_one_line_and_status_2(tmp_path, monkeypatch, capsys):
    from minillm.__main__ import main

    monkeypatch.setenv("MINILLM_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    _no_run(monkeypatch)
    with pytest.raises(SystemExit) as e:
        main(["bench", "--engine", "continuous,vllm", *TINY])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "make peer-vllm" in lines[0] and "MINILLM_VLLM_PYTHON" in lines[0], err
    assert out == ""


def test_a_python_without_vllm_is_refused_before_the_run(monkeypatch, capsys):
    monkeypatch.setenv("MINILLM_VLLM_PYTHON", sys.executable)  # this venv has no vllm (never a requirement)
    if vllm_runner._imports_vllm(sys.executable):
        pytest.skip("this Python has vllm")
    _no_run(monkeypatch)
    with pytest.raises(SystemExit) as e:
        compare.main(["--engine", "vllm", *TINY])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot import vllm" in err[0] and "make peer-vllm" in err[0]


def _fake_python(path, record=None):
    """A stand-in for vLLM's Python: answers the probe, and runs a job as vllm_peer.py would,
    with tokens from $FAKE_VLLM_TOKENS (else 7s), 10 ms apart."""
    path.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, os, sys, time
        if sys.argv[1] == "-c":  # bench asks whether vllm can be imported
            sys.exit(0)
        job = json.load(open(sys.argv[2]))
        if {str(record)!r} != "None":
            json.dump({{"job": job, "env": dict(os.environ)}}, open({str(record)!r}, "w"))
        given = json.loads(os.environ.get("FAKE_VLLM_TOKENS", "[]"))
        start = 100.0
        reqs = []
        for i, r in enumerate(job["requests"]):
            toks = given[i] if i < len(given) else [7] * r["max_tokens"]
            times = [start + 0.05 + 0.01 * k for k in range(len(toks))]
            reqs.append({{"token_ids": toks, "token_times": times, "finish_time": times[-1],
                         "arrival_time": start + r["arrival_time"]}})
        json.dump({{"vllm_version": "fake", "start": start, "end": max(r["finish_time"] for r in reqs),
                   "requests": reqs, "dtype": job["dtype"], "device": "cpu", "num_blocks": 4, "block_size": 16,
                   "kv_cache_bytes": 12345, "enable_chunked_prefill": True}}, open(sys.argv[3], "w"))
        """))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_find_vllm_python_order(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    monkeypatch.setattr(vllm_runner, "repo_root", lambda: tmp_path)
    monkeypatch.delenv("MINILLM_VLLM_PYTHON", raising=False)
    with pytest.raises(vllm_runner.VllmNotFound, match="vLLM is not installed: run `make peer-vllm`"):
        vllm_runner.find_vllm_python()
    local = tmp_path / ".venv-vllm" / "bin" / "python"
    local.parent.mkdir(parents=True)
    _fake_python(local)
    assert vllm_runner.find_vllm_python() == str(local)
    other = _fake_python(tmp_path / "other-python")
    monkeypatch.setenv("MINILLM_VLLM_PYTHON", str(other))  # the variable comes first
    assert vllm_runner.find_vllm_python() == str(other)


def test_dtype_reaches_every_engine(tmp_path, monkeypatch):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from minillm import loader

    def tiny_hf_model(weights, cfg, dtype=torch.float32):  # the baseline's dtype is the point, not its size
        c = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, bos_token_id=cfg.bos_token_id,
                        eos_token_id=cfg.eos_token_id, pad_token_id=cfg.eos_token_id)
        return LlamaForCausalLM(c).to(dtype).eval()

    monkeypatch.setattr(loader, "hf_model_from_weights", tiny_hf_model)
    out = tmp_path / "b.json"
    assert compare.main(["--engine", "continuous,hf-generate", *TINY, "--dtype", "bfloat16", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["continuous"]["dtype"] == "bfloat16" and got["hf-generate"]["dtype"] == "bfloat16"
    assert got["continuous"]["output_tokens"] == 6


def test_bf16_with_the_triton_backend_on_the_cpu_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit) as e:
        compare.main(["--engine", "continuous", *TINY, "--dtype", "bfloat16", "--attention-backend", "triton"])
    assert e.value.code == 2 and "bfloat16" in capsys.readouterr().err


def test_vllm_result_through_a_fake_runner(tmp_path, monkeypatch, capsys):
    """The job vLLM gets, and what bench makes of its answer: fields, None where unknown, same_tokens_as."""
    from minillm.bench.workload import make_workload

    record = tmp_path / "job-seen.json"
    monkeypatch.setenv("MINILLM_VLLM_PYTHON", str(_fake_python(tmp_path / "fake-python", record)))
    monkeypatch.setattr(compare, "vllm_model_dir", lambda dummy_weights=False: tmp_path / "model")
    wl = make_workload("uniform", 2, 0, None, prompt_len=8, output_len=3)
    ref = compare.run_benchmark(["continuous"], wl, max_num_seqs=2, dummy_weights=True, progress=False)[0]
    # vLLM "agrees" on the first request only.
    monkeypatch.setenv("FAKE_VLLM_TOKENS", json.dumps([ref.output_token_ids[0], [1, 2, 3]]))
    out = tmp_path / "b.json"
    assert compare.main(["--engine", "continuous,vllm", *TINY, "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    v, c = got["vllm"], got["continuous"]
    assert v["same_tokens_as"] == {"engine": "continuous", "fraction": 0.5, "first_difference": [None, 0]}
    assert c["same_tokens_as"]["fraction"] == 1.0
    assert v["dtype"] == c["dtype"] == "float32"
    assert v["output_tokens"] == 6 and v["num_requests"] == 2 and v["vllm_version"] == "fake"
    assert v["wall_s"] == pytest.approx(0.07) and v["output_tokens_per_s"] == pytest.approx(6 / 0.07)
    assert v["ttft_s"]["p50"] == pytest.approx(0.05) and v["tpot_s"]["p50"] == pytest.approx(0.01)
    assert v["kv_reserved_bytes"] == 12345
    for unknown in ("forward_passes", "slot_utilization", "kv_used_bytes_peak", "kv_waste_fraction",
                    "max_concurrency", "preemptions", "decode_stall_steps"):
        assert v[unknown] is None, unknown
    seen = json.loads(record.read_text())
    job, env = seen["job"], seen["env"]
    assert [r["prompt_token_ids"] for r in job["requests"]] == [r.prompt_token_ids for r in wl]
    assert [r["max_tokens"] for r in job["requests"]] == [3, 3]
    assert (job["max_num_seqs"], job["dtype"], job["max_model_len"]) == (2, "float32", c["max_model_len"])
    assert job["model"] == str(tmp_path / "model") and job["skip_tokenizer_init"] is True
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and env["OMP_NUM_THREADS"] == "1"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "vllm" in capsys.readouterr().out  # the table has its row


def test_chunked_prefill_runs_beside_vllm_and_is_refused_beside_other_engines(tmp_path, monkeypatch):
    """vLLM always mixes prompt chunks into decode steps: paged,vllm with the flag compares one policy."""
    monkeypatch.setenv("MINILLM_VLLM_PYTHON", str(_fake_python(tmp_path / "fake-python")))
    monkeypatch.setattr(compare, "vllm_model_dir", lambda dummy_weights=False: tmp_path / "model")
    out = tmp_path / "b.json"
    assert compare.main(["--engine", "paged,vllm", "--enable-chunked-prefill", *TINY, "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["paged"]["enable_chunked_prefill"] is True and got["vllm"]["enable_chunked_prefill"] is True
    for engines in (["continuous", "vllm"], ["paged", "static"]):
        with pytest.raises(ValueError, match="run it with --engine paged"):
            compare.check_chunked_prefill(engines, True)
    compare.check_chunked_prefill(["continuous", "vllm"], False)


def test_peer_replay_loop_with_a_fake_engine(capsys):
    """vllm_peer.run: arrivals in order, delta outputs gathered per request (ids vLLM suffixes), times."""
    import importlib.util
    from types import SimpleNamespace as NS

    spec = importlib.util.spec_from_file_location("vllm_peer", vllm_runner.VLLM_PEER)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)  # stdlib only at import: vllm is imported inside main()

    class FakeEngine:  # one token per running request per step, ids suffixed as vLLM does
        def __init__(self):
            self.live = {}

        def add_request(self, rid, prompt, params):
            self.live[rid + "-abcd1234"] = [len(prompt["prompt_token_ids"]), params]

        def has_unfinished_requests(self):
            return bool(self.live)

        def step(self):
            outs = []
            for rid, st in list(self.live.items()):
                st[0] += 1
                st[1] -= 1
                outs.append(NS(request_id=rid, outputs=[NS(token_ids=[st[0]])], finished=st[1] == 0))
                if st[1] == 0:
                    del self.live[rid]
            return outs

    clock = iter(range(1000))
    reqs = [{"prompt_token_ids": [5, 6], "max_tokens": 3, "arrival_time": 0.0},
            {"prompt_token_ids": [7], "max_tokens": 1, "arrival_time": 0.0}]
    start, end, recs = peer.run(FakeEngine(), reqs, lambda r: r["max_tokens"], now=lambda: float(next(clock)),
                                heartbeat_s=1.0)
    assert "vllm: 4/4 tokens" in capsys.readouterr().err
    assert [r["token_ids"] for r in recs] == [[3, 4, 5], [2]]
    assert len(recs[0]["token_times"]) == 3 and recs[0]["finish_time"] == recs[0]["token_times"][-1] == end
    assert recs[1]["finish_time"] == recs[1]["token_times"][0] < end and recs[0]["arrival_time"] == start


def test_the_model_folder_for_vllm_is_written_once(tmp_path, monkeypatch):
    import torch
    from safetensors.torch import load_file

    from minillm import cache, loader
    from minillm.config import ModelConfig

    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    folder = vllm_runner.vllm_model_dir(dummy_weights=True)
    assert folder.parent == tmp_path and (folder / "config.json").is_file()
    assert json.loads((folder / cache.FOLDER_MARK).read_text())["source"].startswith("minillm dummy weights")
    saved = load_file(str(folder / "model.safetensors"))
    want = loader.hf_state_dict(loader.dummy_weights(ModelConfig()), ModelConfig())
    for name in ("model.embed_tokens.weight", "model.layers.3.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        assert torch.equal(saved[name], want[name]), name
    assert [p.name for p in tmp_path.iterdir()] == [folder.name], "a temporary folder was left behind"

    def must_not_write(*args, **kwargs):
        raise AssertionError("the complete folder was written again")

    monkeypatch.setattr(loader, "hf_model_from_weights", must_not_write)
    assert vllm_runner.vllm_model_dir(dummy_weights=True) == folder

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("MINILLM_CACHE", str(blocked / "cache"))
    with pytest.raises(OSError, match="MINILLM_CACHE"):
        vllm_runner.vllm_model_dir(dummy_weights=True)
