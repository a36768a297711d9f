"""Medusa heads measured on SmolLM2: drafters side by side, and the exactness table of the tree rules.

    python -m minillm.bench.medusa_measure [--heads PATH] [--prompts N] [--max-tokens T] [--rounds R]
                                           [--batch B ...] [--samples N] [--skip drafters|exactness]
                                           [--json PATH]

1. **Drafters at batch 1 and under load** (``compare_drafters``): the open chat prompts of
   chapter 5 (new text, little to look up), greedy, one request at a time and then 8 at a
   time (``--batch``), through one engine each: plain
   decoding, n-gram (k = 4), chapter 5's self-draft (the first 8 layers, k = 4), a Medusa
   chain (k = the heads) and a Medusa tree (``TREE``). Per engine: tokens per target
   forward, acceptance, output tokens/s. Every engine must give plain decoding's tokens.
   Rounds alternate the order of the engines (a round: every engine over every prompt), so
   drift in the machine's speed falls on all alike; the median round is reported.
2. **Exactness on the real model** (``exactness_table``): the joint distribution of the
   first two tokens of a prompt, at temperature T with top-k, known exactly from the model
   (1 + top-k forwards), against n samples of the tree's walk (``spec_decode/tree.walk_tree``
   with the engine's per-position noise) over the target's distributions at the tree's
   nodes, the candidates from the heads. Each rule (exact, typical) at each temperature:
   tokens per round, TV against the threshold of chapter 5's test (``exactness.tv_threshold``,
   delta 1e-6), and Pearson's chi-square p-value.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from minillm.spec_decode.tree import MEDUSA_TREE as TREE
SELF_DRAFT_LAYERS = list(range(8))  # chapter 5's cheap self-draft


def drafter_configs(heads: Any, tree: list | None = None) -> dict[str, dict | None]:
    """The ``speculative`` option of each engine compared (None: plain decoding)."""
    always = {"disable_by_batch_size": None}
    num_heads = heads.num_heads if hasattr(heads, "num_heads") else _num_heads(heads)
    return {
        "plain": None,
        "n-gram, k=4": {"method": "ngram", "num_speculative_tokens": 4, **always},
        "self-draft (8 layers), k=4": {"method": "model", "draft_layers": SELF_DRAFT_LAYERS,
                                       "num_speculative_tokens": 4, **always},
        f"Medusa chain, k={num_heads}": {"method": "medusa", "heads": heads, "num_speculative_tokens": num_heads,
                                         **always},
        f"Medusa tree, {len(tree or TREE)} nodes": {"method": "medusa", "heads": heads, "tree": tree or TREE,
                                                    **always},
    }


def _num_heads(path) -> int:
    from minillm.spec_decode.medusa import read_metadata

    return int(read_metadata(path)["num_heads"])


def compare_drafters(prompts: list[list[int]], configs: dict[str, dict | None], max_tokens: int = 64,
                     rounds: int = 3, batch: int = 1, build=None, progress=None) -> dict[str, dict[str, Any]]:
    """Each engine over every prompt, ``rounds`` times, in alternating order: one request at a
    time (``batch`` 1), or ``batch`` at a time (all arrive together; the engine runs them as
    one continuous batch). Returns per engine: tokens_per_s (median round),
    tokens_per_target_forward, acceptance_rate, same_tokens (as plain decoding's), speedup
    (tokens/s against plain's) and each round's tokens/s.

    ``build(speculative, max_num_seqs)`` makes an engine (an ``LLMEngine``); by default an
    ``LLM`` of the installed model."""
    from minillm import SamplingParams

    if build is None:
        from minillm import LLM

        def build(spec, max_num_seqs):
            return LLM(engine="paged", max_num_seqs=max_num_seqs, max_model_len=1024, speculative=spec).engine

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engines = {name: build(spec, batch) for name, spec in configs.items()}
    for engine in engines.values():  # warm-up: first-use costs out of the timed runs
        engine.run([engine.make_request(list(prompts[0][:16]), SamplingParams(temperature=0, max_tokens=4))])
    names = list(engines)
    results: dict[str, dict[str, Any]] = {n: {"round_tokens_per_s": []} for n in names}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            engine = engines[name]
            if engine.speculator is not None:
                engine.speculator.reset_stats()
            tokens, wall, outs = 0, 0.0, []
            for i in range(0, len(prompts), batch):
                start = time.perf_counter()
                done = engine.run([engine.make_request(list(p), params) for p in prompts[i:i + batch]])
                wall += time.perf_counter() - start
                tokens += sum(len(o.token_ids) for o in done)
                outs.extend(list(o.token_ids) for o in done)
                if progress is not None:
                    progress(len(done))
            res = results[name]
            res["round_tokens_per_s"].append(tokens / wall)
            outputs[name] = outs
            st = engine.spec_stats
            if st is not None:
                res["tokens_per_target_forward"] = st.tokens_per_target_forward
                res["acceptance_rate"] = st.acceptance_rate
    for name in names:
        res = results[name]
        res["tokens_per_s"] = statistics.median(res["round_tokens_per_s"])
        res.setdefault("tokens_per_target_forward", 1.0)
        res.setdefault("acceptance_rate", None)
        res["same_tokens"] = outputs[name] == outputs["plain"]
        res["speedup"] = res["tokens_per_s"] / results["plain"]["tokens_per_s"]
    return results


# ---------------------------------------------------------------- exactness on the real model


class RealModel:
    """SmolLM2 (transformers' Llama holding the engine's weights, fp32) as the exactness test's
    toy-model interface: ``probs(prefix)`` the distribution a request with ``params`` samples
    from after prompt + prefix, ``ranking(ctx)`` the heads' candidates for a tree rooted at
    ctx's last token (from the hidden state the root was sampled from). Cached by sequence."""

    def __init__(self, hf, heads, prompt: list[int], params, width: int, depth: int):
        self.hf, self.heads = hf, heads
        self.prompt, self.params, self.width, self.depth = tuple(prompt), params, width, depth
        self._hidden: dict[tuple[int, ...], torch.Tensor] = {}
        self._probs: dict[tuple[int, ...], torch.Tensor] = {}

    @torch.inference_mode()
    def _forward(self, seq: tuple[int, ...]) -> None:
        from minillm.spec_decode.rejection_sampler import target_probs_from_logits

        h = self.hf.model(input_ids=torch.tensor([seq])).last_hidden_state[0, -1].float()  # [hidden]
        self._hidden[seq] = h
        p = target_probs_from_logits(self.hf.lm_head(h[None]).float()[None], [self.params])[0, 0].double()
        self._probs[seq] = p / p.sum()

    def probs(self, prefix: tuple[int, ...]) -> torch.Tensor:
        seq = prefix if prefix[:len(self.prompt)] == self.prompt else self.prompt + prefix
        if seq not in self._probs:
            self._forward(seq)
        return self._probs[seq]

    @torch.inference_mode()
    def ranking(self, ctx: tuple[int, ...]) -> torch.Tensor:
        before_root = ctx[:-1]
        if before_root not in self._hidden:
            self._forward(before_root)
        logits = self.heads(self._hidden[before_root][None], heads=range(self.depth))[:, 0]  # [depth, V]
        return logits.topk(self.width, dim=-1).indices


def exactness_table(heads, prompt: list[int], weights: dict | None = None, tree_choices: list | None = None,
                    temperatures=(0.8, 1.0), top_k: int = 4, samples: int = 4000, seed: int = 0,
                    progress=None) -> list[dict[str, Any]]:
    """Rule x temperature: tokens per round, TV and its threshold, chi-square p-value, pass.

    ``heads``: a ``MedusaHeads`` or a heads file; ``weights``: the model's (loaded when None)."""
    from minillm import SamplingParams, loader
    from minillm.bench import exactness as ex
    from minillm.spec_decode.medusa import MedusaHeads
    from minillm.spec_decode.tree import build_tree

    weights = loader.load_weights(None) if weights is None else weights
    hf = loader.hf_model_from_weights(weights, loader.read_config(None), torch.float32)
    if not isinstance(heads, MedusaHeads):
        heads = MedusaHeads.load(heads, weights["embed.weight"].float())
    tree = build_tree(tree_choices or TREE)
    rows = []
    for temperature in temperatures:
        params = SamplingParams(temperature=temperature, top_k=top_k)
        model = RealModel(hf, heads, prompt, params, tree.width, tree.depth)
        exact = ex.target_distribution(model.probs, 2, tuple(prompt))
        threshold = ex.tv_threshold(samples, len(exact), delta=1e-6, two_sample=False)
        for rule in ("exact", "typical"):
            got, per_round = ex.sample_tree_coupled(model.probs, model.ranking, tree, samples, 2, seed=seed,
                                                    rule=rule, context=tuple(prompt))
            cells, counts = torch.unique(got, dim=0, return_counts=True)
            freq = {tuple(c): v / samples for c, v in zip(cells.tolist(), counts.tolist())}
            tv = ex.total_variation(freq, exact)
            rows.append(dict(rule=rule, temperature=temperature, top_k=top_k, samples=samples, cells=len(exact),
                             tokens_per_round=per_round, tv=tv, threshold=threshold,
                             p_value=ex.chi_square_p_value(got, exact), passed=tv <= threshold))
            if progress is not None:
                progress(1)
    return rows


def format_drafters(results: dict[str, dict[str, Any]]) -> str:
    lines = ["engine                         tokens/forward  acceptance  tok/s   speedup  same tokens",
             "-----------------------------  --------------  ----------  ------  -------  -----------"]
    for name, r in results.items():
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        lines.append(f"{name:<29}  {r['tokens_per_target_forward']:>14.2f}  {acc:>10}  {r['tokens_per_s']:>6.1f}  "
                     f"{r['speedup']:>6.2f}x  {'yes' if r['same_tokens'] else 'NO'}")
    return "\n".join(lines)


def format_exactness(rows: list[dict[str, Any]]) -> str:
    lines = ["rule     T    tokens/round  TV      threshold  p-value   test",
             "-------  ---  ------------  ------  ---------  --------  ----"]
    for r in rows:
        lines.append(f"{r['rule']:<7}  {r['temperature']:.1f}  {r['tokens_per_round']:>12.2f}  {r['tv']:.4f}  "
                     f"{r['threshold']:>9.4f}  {r['p_value']:.2e}  {'pass' if r['passed'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minillm.bench.medusa_measure", description=__doc__.split("\n")[0])
    ap.add_argument("--heads", default=None, help="Medusa heads file (default: the shipped one)")
    ap.add_argument("--prompts", type=int, default=8, help="open chat prompts (default 8)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (default 64)")
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds of every engine (default 3)")
    ap.add_argument("--batch", type=int, action="append", default=None,
                    help="requests at a time (repeatable; default 1 and 8)")
    ap.add_argument("--samples", type=int, default=4000, help="samples per exactness row (default 4000)")
    ap.add_argument("--skip", choices=["drafters", "exactness"], action="append", default=[])
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    args.batch = args.batch or [1, 8]
    from minillm import loader
    from minillm.bench.prompts import chat_prompts
    from minillm.spec_decode.medusa import SHIPPED

    heads = args.heads or str(SHIPPED)
    tok = loader.load_tokenizer(None)
    report: dict[str, Any] = {"heads": heads, "tree": TREE}
    if "drafters" not in args.skip:
        from tqdm import tqdm

        configs = drafter_configs(heads)
        prompts = chat_prompts(tok, "open", args.prompts)
        for batch in args.batch:
            with tqdm(total=args.rounds * len(configs) * len(prompts), desc=f"batch {batch}", file=sys.stdout) as bar:
                res = compare_drafters(prompts, configs, args.max_tokens, args.rounds, batch, progress=bar.update)
            print(f"\nbatch {batch}, {len(prompts)} open chat prompts, {args.max_tokens} greedy tokens each, "
                  f"median of {args.rounds} alternated rounds:")
            print(format_drafters(res))
            report[f"drafters_batch{batch}"] = res
    if "exactness" not in args.skip:
        prompt = tok("cat dog cat dog cat").input_ids
        rows = exactness_table(heads, prompt, samples=args.samples)
        print(format_exactness(rows))
        report["exactness"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
