"""vLLM side by side: find a Python that imports vllm, write the model folder it reads, and
run ``vllm_peer.py`` there on the same prompt token ids (another Python, a subprocess).

vLLM pins its own torch and transformers, so it never shares minillm's virtualenv; ``make
peer-vllm`` builds ``.venv-vllm``. ``python -m minillm bench --engine continuous,vllm`` calls
``run_vllm`` through ``compare.run_benchmark``.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from minillm.bench.summary import RunResult
from minillm.bench.workload import Workload
from minillm.request import RequestMetrics


VLLM_INSTALL_HINT = ("run `make peer-vllm` (a CPU build of vLLM in .venv-vllm, about 3.5 GB, 5 minutes) or set "
                     "MINILLM_VLLM_PYTHON to a Python that can import vllm")
VLLM_PEER = Path(__file__).with_name("vllm_peer.py")


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def _imports_vllm(python: str) -> bool:
    """Whether ``python`` runs and finds the vllm package (found, not imported: that takes seconds)."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def find_vllm_python() -> str:
    """A Python that can import vllm: $MINILLM_VLLM_PYTHON (when set, the only one tried), else
    ``.venv-vllm/bin/python`` at the repository root, else this Python if it has vllm.

    Raises ``VllmNotFound`` (one line: how to get one) when there is none."""
    given = os.environ.get("MINILLM_VLLM_PYTHON")
    if given:
        if _imports_vllm(given):
            return given
        raise VllmNotFound(f"MINILLM_VLLM_PYTHON={given} cannot import vllm: point it at a Python that can, or "
                           "unset it and run `make peer-vllm` (a CPU build of vLLM in .venv-vllm, about 3.5 GB)")
    local = repo_root() / ".venv-vllm" / "bin" / "python"
    if local.exists() and _imports_vllm(str(local)):
        return str(local)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise VllmNotFound(f"vLLM is not installed: {VLLM_INSTALL_HINT}")


class VllmNotFound(RuntimeError):
    """No Python that can import vllm: the message says how to get one."""


class VllmFailed(RuntimeError):
    """The vLLM run failed: the message ends with the last lines of its log."""


def vllm_env(threads: int | None = None) -> dict[str, str]:
    """The environment bench gives vLLM (for all but OMP_NUM_THREADS, a variable already set in ours wins):

    * ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core runs in the runner's process,
      as minillm's engine runs in bench's. By default vLLM starts an engine-core process
      and (on the CPU) a worker process, and its auto binding keeps a core for the
      scheduler: on a machine with few cores that extra process competes with the model.
    * ``VLLM_CPU_OMP_THREADS_BIND=nobind`` and ``OMP_NUM_THREADS`` = minillm's torch threads
      (``--threads``, else torch's count before the first engine ran): vLLM computes with
      as many threads as minillm at most, unpinned like minillm's. (``auto``, vLLM's default, pins one thread per physical core
      of a NUMA node and reserves one for the scheduler.)
    * The KV cache is not set here (``VLLM_CPU_KVCACHE_SPACE``, GiB): the runner passes
      ``kv_cache_memory_bytes``, the bytes of minillm's contiguous engine. Setting
      ``VLLM_CPU_KVCACHE_SPACE`` overrides it.
    * Offline (``HF_HUB_OFFLINE``), no usage reports, log level WARNING.
    """
    import torch

    want = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "VLLM_LOGGING_LEVEL": "WARNING"}
    env = {k: os.environ.get(k, v) for k, v in want.items()}
    env["OMP_NUM_THREADS"] = str(threads or torch.get_num_threads())  # minillm's count (it read ours already)
    return env


VLLM_ENV_RECORDED = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS",
                     "VLLM_CPU_KVCACHE_SPACE")


def vllm_model_dir(dummy_weights: bool = False) -> Path:
    """A Hugging Face model folder of the model (config, safetensors, tokenizer), for vLLM.

    Written once by transformers' ``save_pretrained`` from the weights minillm loads from the
    GGUF (and the GGUF's tokenizer) into $MINILLM_CACHE (default ~/.cache/minillm), named
    after the GGUF file's contents (``loader.cache_key``); later runs reuse it. ``dummy_weights``: minillm's seeded
    dummy weights, no tokenizer."""
    from minillm import cache, loader
    from minillm.config import ModelConfig

    if dummy_weights:
        name = "hf-dummy-seed0"
    else:
        gguf = loader.find_gguf()
        name = f"hf-{gguf.stem}-{loader.cache_key(gguf)}"
    folder = cache.cache_dir() / name

    def write(tmp: Path) -> None:
        # minillm's own float32 weights under transformers' Llama names (a model transformers
        # loads from the GGUF keeps a quantization tag and refuses save_pretrained).
        if dummy_weights:
            cfg = ModelConfig()
            weights, tokenizer = loader.dummy_weights(cfg), None
        else:
            cfg = loader.read_config(gguf)
            weights, tokenizer = loader.load_weights(gguf), loader.load_tokenizer(gguf)
        print(f"writing a Hugging Face copy of the model for vLLM to {folder} (once)", file=sys.stderr)
        loader.hf_model_from_weights(weights, cfg).save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))

    source = "minillm dummy weights, seed 0" if dummy_weights else str(gguf)
    if not cache.cached_folder(folder, write, source=source):
        raise OSError(f"could not write the model folder for vLLM to {folder}: "
                      "set MINILLM_CACHE to a writable folder")
    return folder


def run_vllm(workload: Workload, *, model_dir: str | os.PathLike, dtype: str, max_num_seqs: int,
             max_model_len: int, max_num_batched_tokens: int, kv_cache_memory_bytes: int | None = None,
             python: str | None = None, threads: int | None = None, enforce_eager: bool = False,
             skip_tokenizer_init: bool = False, progress: bool = False) -> RunResult:
    """``workload`` through vLLM, in the Python ``find_vllm_python`` finds, via ``vllm_peer.py``.

    Per request: its tokens and the time of each (TTFT, TPOT, ITL, E2E as for every engine).
    What vLLM does not report here (its per-step batches: forward passes, slot utilization,
    KV use per step, preemptions) is None in the result, not estimated."""
    import tempfile

    python = python or find_vllm_python()
    reqs = list(workload)
    job = dict(model=str(model_dir), dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
               max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory_bytes=kv_cache_memory_bytes,
               enforce_eager=enforce_eager, skip_tokenizer_init=skip_tokenizer_init, seed=0,
               heartbeat_s=30.0 if progress else None,
               requests=[dict(prompt_token_ids=list(r.prompt_token_ids), max_tokens=r.max_tokens,
                              arrival_time=r.arrival_time) for r in reqs])
    env = {**os.environ, **vllm_env(threads)}
    with tempfile.TemporaryDirectory(prefix="minillm-vllm-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        if progress:
            print(f"vllm: {python} {VLLM_PEER.name} ({len(reqs)} requests)", file=sys.stderr, flush=True)
        proc = subprocess.Popen([python, str(VLLM_PEER), str(job_path), str(out_path)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp)
        tail: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:  # vLLM's own log, passed on (to stderr: stdout is the table)
            tail = (tail + [line.rstrip()])[-30:]
            if progress:
                print(line, end="", file=sys.stderr, flush=True)
        rc = proc.wait()
        if rc != 0 or not out_path.is_file():
            raise VllmFailed(f"vLLM ({python}) failed with exit status {rc}; the end of its log:\n" + "\n".join(tail))
        got = json.loads(out_path.read_text())
    metrics, outputs = [], []
    for r in got["requests"]:
        t = [float(x) for x in r["token_times"]]
        metrics.append(RequestMetrics(arrival_time=r["arrival_time"], first_token_time=t[0] if t else None,
                                      token_times=t, finish_time=r["finish_time"]))
        outputs.append([int(x) for x in r["token_ids"]])
    if len(outputs) != len(reqs):
        raise VllmFailed(f"vLLM returned {len(outputs)} results for {len(reqs)} requests")
    kv = got.get("kv_cache_bytes")
    unknown = dict.fromkeys(("forward_passes", "slot_utilization", "mean_running", "kv_reserved_bytes_peak",
                             "kv_used_bytes_peak", "kv_waste_fraction", "max_concurrency", "preemptions",
                             "max_step_tokens", "decode_stall_steps", "prefill_tokens_requested",
                             "prefix_hit_tokens", "prefill_tokens_computed", "prefix_hit_rate",
                             "cached_blocks_peak"))
    extra = {**unknown, "kv_reserved_bytes": kv, "vllm_version": got.get("vllm_version"),
             "vllm_python": python, "vllm_device": got.get("device"), "vllm_dtype": got.get("dtype"),
             "vllm_num_blocks": got.get("num_blocks"), "block_size": got.get("block_size"),
             "vllm_enable_chunked_prefill": got.get("enable_chunked_prefill"),
             "vllm_async_scheduling": got.get("async_scheduling"), "vllm_enforce_eager": got.get("enforce_eager"),
             "vllm_env": {k: env[k] for k in VLLM_ENV_RECORDED if k in env}}
    return RunResult("vllm", metrics, outputs, [], got["start"], got["end"], max_num_seqs, kv or 0,
                     [len(r.prompt_token_ids) for r in reqs], extra=extra)
