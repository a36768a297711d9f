"""Tensor parallelism (minillm/distributed/): N processes on gloo give the unsplit model's
numbers, every engine gives a request its tokens alone, and no worker outlives a failure.

The ranks are real processes joined by torch.distributed's gloo backend on this machine;
the models are tiny (random weights large enough that greedy tokens vary), so a test
spends its time starting processes, not computing.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from minillm import SamplingParams
from minillm.config import EngineConfig, ModelConfig
from minillm.distributed.sharding import allreduce_bytes_per_step, shard_weights, split_sizes
from minillm.engine import build_engine
from minillm.model_runner import prompt_logits

TINY = ModelConfig(vocab_size=128, hidden_size=48, intermediate_size=100, num_layers=2, num_heads=6, num_kv_heads=3,
                   head_dim=8, max_position_embeddings=256)


def random_weights(cfg: ModelConfig, seed: int, std: float = 0.3) -> dict[str, torch.Tensor]:
    """Weights of ``cfg`` drawn at ``std`` (norms at 1): large enough that greedy tokens vary."""
    with torch.device("meta"):
        from minillm.model import Llama

        shapes = {k: v.shape for k, v in Llama(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.ones(s) if "norm" in k else torch.randn(s, generator=g) * std) for k, s in shapes.items()}


def engine(n: int, cfg: ModelConfig = TINY, weights=None, **kw):
    weights = random_weights(cfg, 0) if weights is None else weights
    kw.setdefault("engine", "paged")
    kw.setdefault("max_model_len", 128)
    return build_engine(EngineConfig(tensor_parallel_size=n, attention_backend=kw.pop("attention_backend", "cpu"),
                                     cpu_threads=1, **kw), weights=weights, tokenizer=None, model_config=cfg)


def generate(eng, prompts, max_tokens=10):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in eng.run([eng.make_request(p, sp) for p in prompts])]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, seconds: float = 15.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


PROMPTS = [[1, 5, 9, 13, 7, 3], [1, 22, 33, 44], [1, 9, 8, 7, 6, 5, 4, 3, 2, 10, 11], [1, 100, 3]]


def test_split_sizes_and_shards_cover_every_weight_once():
    assert split_sizes(3, 2) == [2, 1] and split_sizes(1536, 4) == [384] * 4
    with pytest.raises(ValueError, match="at least one"):
        split_sizes(2, 3)
    w = random_weights(TINY, 1)
    shards = [shard_weights(TINY, w, 2, r) for r in range(2)]
    for name in ("layers.0.attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):  # row-parallel: columns
        torch.testing.assert_close(torch.cat([s[name] for s in shards], dim=1), w[name], rtol=0, atol=0)
    gate_up = [s["layers.1.mlp.gate_up_proj.weight"].chunk(2) for s in shards]
    torch.testing.assert_close(torch.cat([g for g, _ in gate_up] + [u for _, u in gate_up]),
                               w["layers.1.mlp.gate_up_proj.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_sharded_model_equals_the_unsplit_one_for_random_shapes(n):
    """Random head counts, head sizes, widths and MLP columns (uneven splits included); the
    ranks are gloo processes. Summation order differs, so the promise is closeness, not bits."""
    rng = random.Random(100 + n)
    for trial in range(2):
        kv = rng.randint(n, n + 2)
        cfg = ModelConfig(vocab_size=96, hidden_size=rng.choice([32, 48, 64]), num_layers=2,
                          intermediate_size=rng.randint(4 * n, 90), num_kv_heads=kv, num_heads=kv * rng.randint(1, 3),
                          head_dim=rng.choice([8, 16]), max_position_embeddings=128)
        w = random_weights(cfg, trial)
        ids = [rng.randrange(cfg.vocab_size) for _ in range(rng.randint(5, 40))]
        want = prompt_logits(engine(1, cfg, w).model, ids)  # the unsplit engine, same backend and layout
        eng = engine(n, cfg, w)
        try:
            runner = eng.runner
            got = runner.prompt_logits(ids) if n > 1 else prompt_logits(eng.model, ids)
        finally:
            eng.close()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{cfg}, {n} ranks: {m}")
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("kind", ["simple", "static", "continuous", "paged", "paged-chunked", "paged-preempt"])
def test_every_engine_gives_each_request_its_tokens_alone(kind):
    kw = {"engine": kind.split("-")[0]}
    if kind == "paged-chunked":
        kw.update(enable_chunked_prefill=True, max_num_batched_tokens=8)
    if kind == "paged-preempt":
        kw.update(num_blocks=4, block_size=8, max_model_len=32)  # four requests of up to 21 tokens: someone waits
    alone = engine(1, engine="paged")
    want = [generate(alone, [p])[0] for p in PROMPTS]
    assert len({t for ids in want for t in ids}) > 5, "the test model's greedy tokens should vary"
    eng = engine(2, **kw)
    try:
        got = generate(eng, PROMPTS)
        if kind == "paged-preempt":
            assert eng.snapshot().num_preemptions > 0, "the tight cache should have preempted"
    finally:
        eng.close()
    assert got == want


def test_all_reduced_bytes_match_the_formula_and_the_step_splits():
    eng = engine(2)
    try:
        generate(eng, PROMPTS[:2], max_tokens=4)
        c = eng.runner.counts()
    finally:
        eng.close()
    assert c["all_reduce_calls"] == 2 * TINY.num_layers * c["steps"]
    assert c["all_reduce_bytes"] == c["formula_bytes"] == allreduce_bytes_per_step(TINY.num_layers, TINY.hidden_size,
                                                                                    c["tokens"], 4)
    assert 0 < c["all_reduce_s"] < c["forward_s"] and c["compute_s"] > 0


def test_bad_sizes_are_clear_errors():
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="more than the model's 3 KV heads"):
        engine(4)
    with pytest.raises(ValueError, match="compile"):
        EngineConfig(tensor_parallel_size=2, compile=True)
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(tensor_parallel_size=2, quantization="int8")


def test_close_stops_the_workers():
    eng = engine(3)
    pids = [p.pid for p in eng.runner.procs]
    assert all(alive(p) for p in pids)
    eng.close()
    assert wait_gone(pids, 5) == []
    with pytest.raises(RuntimeError, match="build a new LLM"):
        generate(eng, PROMPTS[:1])


def test_a_worker_killed_mid_run_is_a_clear_error_and_stops_the_others():
    eng = engine(3)
    pids = [p.pid for p in eng.runner.procs]
    assert generate(eng, PROMPTS[:1])
    os.kill(pids[0], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 .*died"):
        generate(eng, PROMPTS)
    assert time.monotonic() - start < 30
    assert wait_gone(pids, 10) == []
    with pytest.raises(RuntimeError, match="has stopped"):
        generate(eng, PROMPTS[:1])


_SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from test_tensor_parallel import engine, generate, PROMPTS
    if __name__ == "__main__":
        eng = engine(3)
        print(" ".join(str(p.pid) for p in eng.runner.procs), flush=True)
        while True:
            generate(eng, PROMPTS)
""")


@pytest.mark.parametrize("how", ["SIGKILL to the engine's process", "Ctrl-C (SIGINT to the process group)"])
def test_no_orphan_workers_when_the_engine_process_dies(how, tmp_path):
    script = tmp_path / "tp_engine.py"
    script.write_text(_SCRIPT.format(tests=os.path.dirname(__file__)))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        line = proc.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, f"expected two worker pids, got {line!r}; stderr: {proc.stderr.read()[-2000:]}"
        time.sleep(1.0)  # in the middle of steps
        if how.startswith("SIGKILL"):
            proc.kill()
        else:
            os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
        assert wait_gone(pids, 15) == [], f"workers {pids} outlived their engine ({how})"
        if not how.startswith("SIGKILL"):
            assert "KeyboardInterrupt" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_all_reduce_timing_leaves_the_step_counts_alone():
    eng = engine(2)
    try:
        generate(eng, PROMPTS[:1], max_tokens=3)
        before = eng.runner.counts()
        seconds = eng.runner.time_all_reduce(TINY.hidden_size, calls=20)
        assert 0 < seconds < 1
        assert eng.runner.counts() == before
        assert generate(eng, PROMPTS[:1], max_tokens=3)  # the ranks are still in step
    finally:
        eng.close()


_TORCHRUN_SCRIPT = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {tests!r})
    from test_tensor_parallel import engine, generate, PROMPTS
    eng = engine(2)  # ranks 1..N-1 serve inside this call and exit when rank 0 closes
    assert os.environ["RANK"] == "0" and not eng.runner.procs
    print("TOKENS " + json.dumps(generate(eng, PROMPTS)), flush=True)
    eng.close()
""")


def test_torchrun_starts_the_ranks_instead_of_the_engine(tmp_path):
    """``torchrun --nproc-per-node 2 script.py``: every process runs the same script; rank 1
    serves inside ``LLM(...)``, rank 0 is the engine. (Across machines: --nnodes, not tested here.)"""
    script = tmp_path / "tp_torchrun.py"
    script.write_text(_TORCHRUN_SCRIPT.format(tests=os.path.dirname(__file__)))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
               OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("TOKENS "))
    alone = engine(1)
    assert json.loads(line[len("TOKENS "):]) == generate(alone, PROMPTS)


def test_bench_runs_tensor_parallel_engines(tmp_path):
    """``bench --tensor-parallel-size 2``: every minillm engine split over two processes, the
    same tokens as one process, rank 0's compute/communication split in the JSON."""
    from minillm.bench import compare

    common = ["--engine", "paged,continuous", "--dummy-weights", "--workload", "uniform", "--num-requests", "3",
              "--workload-param", "prompt_len=8", "--workload-param", "output_len=4", "--max-num-seqs", "2",
              "--max-model-len", "64", "--no-progress"]
    one, two = tmp_path / "tp1.json", tmp_path / "tp2.json"
    assert compare.main(common + ["--json", str(one)]) == 0
    assert compare.main(common + ["--tensor-parallel-size", "2", "--json", str(two)]) == 0
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    for name in ("paged", "continuous"):
        assert b[name]["same_tokens_as"]["fraction"] == 1.0
        assert a[name]["output_tokens"] == b[name]["output_tokens"]
        split = b[name]["tensor_parallel"]
        assert split["world_size"] == 2 and split["all_reduce_bytes"] == split["formula_bytes"] > 0
    assert not any(p.name.startswith("minillm-tp") for p in __import__("multiprocessing").active_children())


@pytest.mark.parametrize("spec", [dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1),
                                  dict(method="model", draft_layers=[0], num_speculative_tokens=2)])
def test_speculation_on_a_split_target_keeps_the_tokens(spec):
    """The drafter runs whole on rank 0 (a self-draft from an unsplit copy); verification on
    the split target: greedy tokens are the plain engine's."""
    want = generate(engine(1), PROMPTS)
    eng = engine(2, speculative=dict(spec, disable_by_batch_size=None))
    try:
        assert generate(eng, PROMPTS) == want
        assert eng.spec_stats.as_dict()["num_drafts"] > 0
    finally:
        eng.close()


def test_a_plugged_shard_or_mlp_that_breaks_its_contract_stops_before_it_is_used():
    """Chapter 10's seams, checked where the library calls them (no processes needed): a slice that
    is a view of the whole matrix, an MLP that all-reduces twice or not at all."""
    import torch.nn.functional as F

    from minillm import seams
    from minillm.distributed.parallel_model import plugged_mlp

    def view(weight, sizes, rank, parallel):
        return weight.narrow(0 if parallel == "column" else 1, sum(sizes[:rank]), sizes[rank])

    with seams.plug(shard_linear=view), pytest.raises(seams.SeamContractError, match="storage of its own"):
        shard_weights(TINY, random_weights(TINY, 1), 2, 0)

    class OneRank:
        rank = 0

        def all_reduce(self, t):
            return t

    def twice(x, gate_up, down, all_reduce):
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return all_reduce(all_reduce(F.linear(F.silu(gate) * up, down)))

    def never(x, gate_up, down, all_reduce):
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down)

    x, gate_up, down = torch.randn(3, 8), torch.randn(12, 8), torch.randn(8, 6)
    for wrong, match in [(twice, "a second all_reduce"), (never, "no all_reduce")]:
        with pytest.raises(seams.SeamContractError, match=match):
            plugged_mlp(wrong, x, gate_up, down, OneRank())
