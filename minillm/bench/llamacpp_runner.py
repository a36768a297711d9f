"""llama.cpp side by side: find a Python that imports llama_cpp (llama-cpp-python) and run
``llamacpp_peer.py`` there on the model's own GGUF and the same prompt token ids (another
Python, a subprocess).

llama-cpp-python builds llama.cpp from source when installed, so it lives in its own
virtualenv: ``make peer-llamacpp`` builds ``.venv-llamacpp``. ``python -m minillm bench
--engine continuous,llamacpp`` calls ``run_llamacpp`` through ``compare.run_benchmark``.
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


def run_llamacpp(workload: Workload, *, gguf_path: str | os.PathLike, threads: int, n_ctx: int,
                 python: str | None = None, progress: bool = False) -> RunResult:
    """``workload`` through llama.cpp, in the Python ``find_llamacpp_python`` finds, via ``llamacpp_peer.py``.

    Batch 1: llama.cpp serves the requests one after the other in order of arrival, each
    from an empty KV cache of ``n_ctx`` tokens; a request that arrives while another runs
    waits, and that wait counts in its TTFT (as a queue does in a batching engine). Every
    request is greedy, exactly ``max_tokens`` tokens with EOS ignored, its prompt fed as
    token ids. ``threads``: llama.cpp's threads, for the prompt and for decoding.

    Per request: its tokens and the time of each (TTFT, TPOT, ITL, E2E as for every engine).
    What this run does not measure (slot utilization, KV use per step, decode stalls, the
    steps' sizes) is None in the result, not estimated."""
    check_context(workload, n_ctx)
    python = python or find_llamacpp_python()
    reqs = list(workload)
    job = dict(model=str(gguf_path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
               heartbeat_s=30.0 if progress else None,
               requests=[dict(prompt_token_ids=list(r.prompt_token_ids), max_tokens=r.max_tokens,
                              arrival_time=r.arrival_time) for r in reqs])
    with tempfile.TemporaryDirectory(prefix="minillm-llamacpp-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        if progress:
            print(f"llamacpp: {python} {LLAMACPP_PEER.name} ({len(reqs)} requests)", file=sys.stderr, flush=True)
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
    metrics, outputs = [], []
    for r in got["requests"]:
        t = [float(x) for x in r["token_times"]]
        metrics.append(RequestMetrics(arrival_time=r["arrival_time"], first_token_time=t[0] if t else None,
                                      token_times=t, finish_time=r["finish_time"]))
        outputs.append([int(x) for x in r["token_ids"]])
    if len(outputs) != len(reqs):
        raise LlamaCppFailed(f"llama.cpp returned {len(outputs)} results for {len(reqs)} requests")
    from minillm import loader

    ctx = int(got.get("n_ctx") or n_ctx)
    kv_bytes = ctx * loader.read_config(gguf_path).kv_bytes_per_token(KV_CACHE_DTYPE_BYTES)
    unknown = dict.fromkeys(("slot_utilization", "mean_running", "kv_reserved_bytes_peak", "kv_used_bytes_peak",
                             "kv_waste_fraction", "max_step_tokens", "decode_stall_steps"))
    prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
    extra = {**unknown, "forward_passes": got.get("forward_passes"), "max_concurrency": 1 if reqs else 0,
             "preemptions": 0,
             # every prompt is prefilled whole: the KV cache is cleared between requests
             "prefill_tokens_requested": prompt_tokens, "prefix_hit_tokens": 0,
             "prefill_tokens_computed": prompt_tokens, "prefix_hit_rate": 0.0, "cached_blocks_peak": None,
             "kv_reserved_bytes": kv_bytes, "llama_cpp_version": got.get("llama_cpp_version"),
             "llamacpp_python": python, "llamacpp_gguf": str(gguf_path), "llamacpp_n_ctx": ctx,
             "llamacpp_n_batch": got.get("n_batch"), "llamacpp_threads": got.get("n_threads", threads)}
    return RunResult("llamacpp", metrics, outputs, [], got["start"], got["end"], 1, kv_bytes,
                     [len(r.prompt_token_ids) for r in reqs], extra=extra)
