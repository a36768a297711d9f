"""llama.cpp side by side: find a Python that imports llama_cpp (llama-cpp-python) and run
``llamacpp_peer.py`` there on the model's own GGUF and the same prompt token ids (another
Python, a subprocess).

llama-cpp-python builds llama.cpp from source when installed, so it lives in its own
virtualenv: ``make peer-llamacpp`` builds ``.venv-llamacpp``. ``python -m minillm bench
--engine continuous,llamacpp`` calls ``run_llamacpp`` through ``compare.run_benchmark``.

Batch 1 by default; ``parallel`` slots (or $MINILLM_LLAMACPP_PARALLEL) serve the requests as
llama.cpp's server does with ``-np``: continuous batching of that many sequences in one
context, one ``llama_decode`` per step.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from minillm.bench.summary import RunResult
from minillm.bench.vllm_runner import repo_root
from minillm.bench.workload import Workload
from minillm.metrics import StepRecord
from minillm.request import RequestMetrics


LLAMACPP_INSTALL_HINT = ("run `make peer-llamacpp` (llama-cpp-python in .venv-llamacpp, built from source: "
                         "minutes) or set MINILLM_LLAMACPP_PYTHON to a Python that can import llama_cpp")
LLAMACPP_PEER = Path(__file__).with_name("llamacpp_peer.py")
# llama.cpp's default KV cache type: K and V in float16.
KV_CACHE_DTYPE_BYTES = 2


class LlamaCppNotFound(RuntimeError):
    """No Python that can import llama_cpp: the message says how to get one."""


class LlamaCppFailed(RuntimeError):
    """The llama.cpp run failed: the message ends with the last lines of its log."""


def _imports_llama_cpp(python: str) -> bool:
    """Whether ``python`` runs and finds the llama_cpp package (found, not imported)."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('llama_cpp') is None)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def find_llamacpp_python() -> str:
    """A Python that can import llama_cpp: $MINILLM_LLAMACPP_PYTHON (when set, the only one
    tried), else ``.venv-llamacpp/bin/python`` at the repository root, else this Python if it
    has llama_cpp.

    Raises ``LlamaCppNotFound`` (one line: how to get one) when there is none."""
    given = os.environ.get("MINILLM_LLAMACPP_PYTHON")
    if given:
        if _imports_llama_cpp(given):
            return given
        raise LlamaCppNotFound(f"MINILLM_LLAMACPP_PYTHON={given} cannot import llama_cpp: point it at a Python "
                               "that can, or unset it and run `make peer-llamacpp` (llama-cpp-python in "
                               ".venv-llamacpp)")
    local = repo_root() / ".venv-llamacpp" / "bin" / "python"
    if local.exists() and _imports_llama_cpp(str(local)):
        return str(local)
    if importlib.util.find_spec("llama_cpp") is not None:
        return sys.executable
    raise LlamaCppNotFound(f"llama.cpp is not installed: {LLAMACPP_INSTALL_HINT}")


def gguf_weight_types(gguf_path: str | os.PathLike) -> str:
    """The GGUF's matrix types, most used first: ``"Q4_1/Q8_0 (gguf)"`` for the shipped model
    (the norms, 1-D and float32, are left out).

    Reading the GGUF's header takes seconds in Python (the vocabulary comes with it): the
    answer is kept in $MINILLM_CACHE, named after the file's contents, as ``loader.read_config`` does."""
    from gguf import GGUFReader

    from minillm import cache, loader

    path = Path(gguf_path)
    cached = cache.cache_dir() / f"{path.stem}-{loader.cache_key(path)}.weight-types.json"
    try:
        return str(json.loads(cached.read_text())["dtype"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent or unreadable: read the GGUF
    counts = Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors if len(t.shape) > 1)
    name = "/".join(name for name, _ in counts.most_common()) + " (gguf)"
    cache.write_atomically(cached, lambda tmp: tmp.write_text(json.dumps({"dtype": name})))
    return name


def check_context(workload: Workload, n_ctx: int) -> None:
    """Every request's prompt and ``max_tokens`` fit in llama.cpp's context of ``n_ctx`` tokens."""
    too_long = [str(r.request_id) for r in workload if len(r.prompt_token_ids) + r.max_tokens > n_ctx]
    if too_long:
        raise ValueError(f"llama.cpp's context holds {n_ctx} tokens (max_model_len): requests "
                         f"{', '.join(too_long)} need more (prompt + max_tokens); raise --max-model-len")


def llamacpp_parallel(parallel: int | None = None) -> int:
    """llama.cpp's parallel slots: ``parallel``, else $MINILLM_LLAMACPP_PARALLEL, else 1 (batch 1)."""
    if parallel is None:
        given = os.environ.get("MINILLM_LLAMACPP_PARALLEL", "").strip()
        try:
            parallel = int(given) if given else 1
        except ValueError:
            raise ValueError(f"MINILLM_LLAMACPP_PARALLEL={given}: want a number of slots >= 1") from None
    if parallel < 1:
        raise ValueError(f"llama.cpp's parallel slots must be >= 1, got {parallel}")
    return parallel


def step_records(steps: list[dict], reqs: list, num_slots: int) -> list[StepRecord]:
    """The peer's steps (one ``llama_decode`` each) as minillm's ``StepRecord``: the varlen slot
    accounting of summary.py (a row feeding n tokens occupies n token-slots, an empty slot 1).
    KV use per step is not recorded (0 here, None in the result)."""
    out = []
    for k, s in enumerate(steps):
        rows, toks = s["requests"], [int(n) for n in s["tokens"]]
        out.append(StepRecord(step=k, start=float(s["start"]), end=float(s["end"]),
                              request_ids=[str(reqs[i].request_id) for i in rows], num_new_tokens=toks,
                              num_sampled=int(s["sampled"]), num_running=int(s["running"]),
                              num_waiting=int(s["waiting"]), num_slots=num_slots,
                              token_slots=sum(toks) + num_slots - len(rows), idle_slots=num_slots - len(rows)))
    return out


def _run_peer(job: dict, python: str, progress: bool, read=None):
    """Run ``llamacpp_peer.py`` on ``job`` in ``python``; its RESULT.json, or ``read(folder, result)``
    while the peer's folder (where it may have written more files) still exists."""
    with tempfile.TemporaryDirectory(prefix="minillm-llamacpp-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        proc = subprocess.Popen([python, str(LLAMACPP_PEER), str(job_path), str(out_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp)
        tail: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:  # llama.cpp's own log, passed on (to stderr: stdout is the table)
            tail = (tail + [line.rstrip()])[-30:]
            if progress:
                print(line, end="", file=sys.stderr, flush=True)
        rc = proc.wait()
        if rc != 0 or not out_path.is_file():
            raise LlamaCppFailed(f"llama.cpp ({python}) failed with exit status {rc}; the end of its log:\n"
                                 + "\n".join(tail))
        got = json.loads(out_path.read_text())
        return got if read is None else read(Path(tmp), got)


def llamacpp_logits(sequences: list[list[int]], *, gguf_path: str | os.PathLike, threads: int,
                    python: str | None = None) -> list:
    """llama.cpp's logits at every position of each token sequence: float32 tensors [len, vocab].

    Each sequence is fed whole from an empty KV cache, as token ids (no BOS added), in the
    Python ``find_llamacpp_python`` finds; the logits are those of the model's GGUF as
    llama.cpp computes them (its own quantized blocks), for a teacher-forced comparison."""
    import numpy as np
    import torch

    seqs = [[int(t) for t in s] for s in sequences]
    if not seqs or any(not s for s in seqs):
        raise ValueError("llamacpp_logits needs at least one sequence, and no empty one")
    n_ctx = max(len(s) for s in seqs)
    job = dict(model=str(gguf_path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, logits_of=seqs)
    python = python or find_llamacpp_python()

    def read(folder: Path, got: dict) -> list:
        files = got.get("logits_files") or []
        if len(files) != len(seqs):
            raise LlamaCppFailed(f"llama.cpp returned logits for {len(files)} of {len(seqs)} sequences")
        out = [torch.from_numpy(np.load(folder / f)) for f in files]
        for s, t in zip(seqs, out):
            if t.dim() != 2 or t.shape[0] != len(s):
                raise LlamaCppFailed(f"llama.cpp's logits have shape {tuple(t.shape)} for a sequence of {len(s)}")
        return out

    return _run_peer(job, python, False, read)


def run_llamacpp(workload: Workload, *, gguf_path: str | os.PathLike, threads: int, n_ctx: int,
                 python: str | None = None, progress: bool = False, parallel: int | None = None,
                 kv_unified: bool = True) -> RunResult:
    """``workload`` through llama.cpp, in the Python ``find_llamacpp_python`` finds, via ``llamacpp_peer.py``.

    ``parallel`` (None: $MINILLM_LLAMACPP_PARALLEL, else 1) is the number of llama.cpp's
    parallel slots. At 1, batch 1: llama.cpp serves the requests one after the other in order
    of arrival, each from an empty KV cache of ``n_ctx`` tokens; a request that arrives while
    another runs waits, and that wait counts in its TTFT (as a queue does in a batching engine).
    Above 1, as llama.cpp's server with ``-np parallel``: one context of ``parallel`` sequences
    and a KV cache of ``parallel x n_ctx`` cells (unified across the sequences, as the job asks
    with ``kv_unified``), one ``llama_decode`` per step of a batch holding a token of every
    decoding sequence and the prompt tokens of admitted ones (``n_ctx`` tokens at most); a
    finished sequence's slot takes the next arrived request (first come, first served).

    Every request is greedy, exactly ``max_tokens`` tokens with EOS ignored, its prompt fed as
    token ids. ``threads``: llama.cpp's threads, for the prompt and for decoding.

    Per request: its tokens and the time of each (TTFT, TPOT, ITL, E2E as for every engine).
    With parallel slots, per step too (forward passes, slot utilization, steps' sizes,
    concurrency, decode stalls). What a run does not measure (KV use per step; at batch 1,
    the per-step numbers) is None in the result, not estimated."""
    check_context(workload, n_ctx)
    parallel = llamacpp_parallel(parallel)
    python = python or find_llamacpp_python()
    reqs = list(workload)
    job = dict(model=str(gguf_path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
               heartbeat_s=30.0 if progress else None,
               requests=[dict(prompt_token_ids=list(r.prompt_token_ids), max_tokens=r.max_tokens,
                              arrival_time=r.arrival_time) for r in reqs])
    if parallel > 1:
        job.update(parallel=parallel, kv_unified=kv_unified)
    if progress:
        print(f"llamacpp: {python} {LLAMACPP_PEER.name} ({len(reqs)} requests, {parallel} slot"
              f"{'s' if parallel > 1 else ''})", file=sys.stderr, flush=True)
    got = _run_peer(job, python, progress)
    metrics, outputs = [], []
    for r in got["requests"]:
        t = [float(x) for x in r["token_times"]]
        metrics.append(RequestMetrics(arrival_time=r["arrival_time"], first_scheduled_time=r.get("scheduled_time"),
                                      first_token_time=t[0] if t else None, token_times=t,
                                      finish_time=r["finish_time"]))
        outputs.append([int(x) for x in r["token_ids"]])
    if len(outputs) != len(reqs):
        raise LlamaCppFailed(f"llama.cpp returned {len(outputs)} results for {len(reqs)} requests")
    from minillm import loader

    ctx = int(got.get("n_ctx") or n_ctx * parallel)  # the whole KV cache: every slot's cells
    kv_bytes = ctx * loader.read_config(gguf_path).kv_bytes_per_token(KV_CACHE_DTYPE_BYTES)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
    extra = {"forward_passes": got.get("forward_passes"), "preemptions": 0,
             # every prompt is prefilled whole: a request's KV cells are dropped when it ends
             "prefill_tokens_requested": prompt_tokens, "prefix_hit_tokens": 0,
             "prefill_tokens_computed": prompt_tokens, "prefix_hit_rate": 0.0, "cached_blocks_peak": None,
             "kv_reserved_bytes": kv_bytes, "kv_reserved_bytes_peak": None, "kv_used_bytes_peak": None,
             "kv_waste_fraction": None, "llama_cpp_version": got.get("llama_cpp_version"),
             "llamacpp_python": python, "llamacpp_gguf": str(gguf_path), "llamacpp_n_ctx": ctx,
             "llamacpp_n_batch": got.get("n_batch"), "llamacpp_threads": got.get("n_threads", threads),
             "llamacpp_parallel": parallel}
    steps: list[StepRecord] = []
    if parallel > 1:  # the per-step numbers come from the peer's steps (summarize)
        steps = step_records(got["steps"], reqs, parallel)
        extra.update(llamacpp_kv_unified=got.get("kv_unified"), llamacpp_n_ctx_per_slot=got.get("n_ctx_per_slot"))
    else:  # batch 1: no per-step record
        extra.update(dict.fromkeys(("slot_utilization", "mean_running", "max_step_tokens", "decode_stall_steps")),
                     max_concurrency=1 if reqs else 0)
    return RunResult("llamacpp", metrics, outputs, steps, got["start"], got["end"], parallel, kv_bytes,
                     [len(r.prompt_token_ids) for r in reqs], extra=extra)
