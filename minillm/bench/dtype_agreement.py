"""How far greedy bf16 output follows greedy fp32 output, token by token.

bf16 keeps 8 bits of mantissa: logits move by ~1e-2, and where the top two tokens of a
step are closer than that, bf16 can pick the other one. From that token on the two
texts are different continuations (both plausible), so "same tokens" is the wrong
question; the useful one is how many tokens agree before the first divergence.

``python -m minillm.bench.dtype_agreement --num-requests 16`` runs one seeded workload
through the same engine in float32 and in bfloat16 and prints, per request, the tokens
that agree before the first difference, and the totals. Exactness tests stay in fp32.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from minillm.bench.compare import first_differences


def agreement(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Per request: leading tokens in common; totals: identical requests, tokens before the first divergence."""
    if len(reference) != len(other):
        raise ValueError(f"compare the same requests: {len(reference)} outputs against {len(other)}")
    # bench's first differing index; None (equal) means the whole reference agrees
    prefix = [len(a) if i is None else i for a, i in zip(reference, first_differences(reference, other))]
    total = sum(len(a) for a in reference)
    return {
        "requests": len(reference),
        "identical_requests": sum(list(a) == list(b) for a, b in zip(reference, other)),
        "agreeing_prefix_tokens": prefix,
        "agreeing_fraction": sum(prefix) / total if total else 1.0,  # of the reference's tokens
    }


def main(argv: list[str] | None = None) -> int:
    from minillm.bench.compare import run_minillm
    from minillm.bench.workload import WORKLOADS, make_workload
    from minillm import loader

    p = argparse.ArgumentParser(prog="python -m minillm.bench.dtype_agreement", description=__doc__.split("\n")[0])
    p.add_argument("--engine", default="continuous")
    p.add_argument("--workload", default="chat", choices=list(WORKLOADS))
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=8)
    args = p.parse_args(argv)
    tokenizer = loader.load_tokenizer()
    weights = loader.load_weights()
    workload = make_workload(args.workload, args.num_requests, args.seed, tokenizer)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        res = run_minillm(args.engine, workload, weights, tokenizer, dtype=dtype, max_num_seqs=args.max_num_seqs)
        runs[dtype] = res
        print(f"{dtype}: {res.output_tokens / res.wall_s:.1f} output tok/s", file=sys.stderr)
    ag = agreement(runs["float32"].output_token_ids, runs["bfloat16"].output_token_ids)
    for r, n, out in zip(workload, ag["agreeing_prefix_tokens"], runs["float32"].output_token_ids):
        print(f"request {r.request_id}: {n} of {len(out)} tokens agree before the first difference")
    print(f"bf16 vs fp32 ({args.engine}, {args.workload} x {args.num_requests}): "
          f"{ag['identical_requests']}/{ag['requests']} requests identical, "
          f"{100 * ag['agreeing_fraction']:.1f}% of fp32's tokens before the first divergence")
    return 0


if __name__ == "__main__":
    sys.exit(main())
