"""What quantized weights cost in quality and buy in speed, measured on this machine.

* ``teacher_forced``: feed the same token sequences to the float32 model and a quantized
  one and compare their next-token logits at every position: how often the argmax agrees,
  the mean and largest |Δlogit|. Teacher forcing compares every position on the same
  context, so one early divergence does not decide the rest (as it does in free generation).
* ``perplexity``: exp of the mean negative log-likelihood of ``HELDOUT_TEXT``, a passage
  written for this purpose and never used to choose anything.
* ``step_times``: one decode step at batch B (context 128), per scheme, the schemes measured
  alternately in rounds (the cores may be shared), with the bytes of weights it reads and
  the floor those bytes set at the measured read bandwidth (the bytes the CPU kernels stream:
  float16 scales and minimums where those hold them exactly, ``weight_bytes_per_step``).

``python -m minillm.bench.quant_measure`` prints both tables for float32, int8 and q4
(``--llamacpp``: and llama.cpp's own logits on the same sequences, from the same GGUF).
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any, Sequence

import torch

HELDOUT_TEXT = (
    "The lighthouse keeper kept two logbooks. In the first he wrote what the instruments said: "
    "the barometer at dawn and dusk, the direction of the wind, the height of the swell against "
    "the third step of the landing. In the second he wrote what he saw, and that book was the "
    "one the harbour master asked for when a ship was late. Numbers, the keeper liked to say, "
    "tell you that something changed; only looking tells you what. On calm evenings he walked "
    "the length of the breakwater and counted the fishing boats coming in, and if one was "
    "missing he climbed back up and turned the lamp a little earlier than the tables required. "
    "Nobody ever told him to do this, and nobody ever told him to stop. When the station was "
    "automated, the engineers who came to fit the new lamp found both logbooks on the shelf, "
    "forty years of them, and argued for an afternoon about which one to send to the archive. "
    "In the end they sent the instrument readings, because they fitted the archive's forms, and "
    "the keeper took the other books home, where his granddaughter later read them aloud, one "
    "winter, to anyone who would listen."
)


def models_for(weights: dict, keys: Sequence[str | None], attention_backend: str = "torch") -> dict:
    """One float32 CPU model per key, built from the same ``weights``: None (float weights, packed
    for oneDNN where the engine packs them), a scheme ("int8", "q4"), or "int8_channel" (the
    int8 scheme with one scale per row in place of groups, for comparison)."""
    from minillm.config import ModelConfig
    from minillm.model import build_model, packs_by_default
    from minillm.quantization import quantize_model

    cfg = ModelConfig()
    out = {}
    for key in keys:
        pack = key is None and packs_by_default(torch.float32)
        m = build_model(cfg, weights, torch.device("cpu"), torch.float32, attention_backend, pack_weights=pack)
        if key == "int8_channel":
            quantize_model(m, "int8", layer_format="int8_channel")
        elif key is not None:
            quantize_model(m, key)
        out[key] = m
    return out


def logits_agreement(reference: Sequence[torch.Tensor], logits: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Two lists of logits [len, vocab], one per sequence, position by position: how often the
    argmax agrees, mean and max |Δlogit|."""
    agree = total = 0
    abs_sum, abs_max = 0.0, 0.0
    for a, b in zip(reference, logits, strict=True):
        if a.shape != b.shape:
            raise ValueError(f"logits of shapes {tuple(a.shape)} and {tuple(b.shape)}: not the same positions")
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
        d = (a.float() - b.float()).abs()
        abs_sum += float(d.mean()) * a.shape[0]
        abs_max = max(abs_max, float(d.max()))
    return {"positions": total, "argmax_agreement": agree / total, "mean_abs_dlogit": abs_sum / total,
            "max_abs_dlogit": abs_max}


@torch.inference_mode()
def all_logits(model, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """``model``'s logits at every position of each sequence, each fed whole."""
    from minillm.model_runner import prompt_logits

    return [prompt_logits(model, list(ids)) for ids in sequences]


def teacher_forced(reference, model, sequences: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Logits of ``model`` against ``reference`` at every position of every sequence (each fed
    whole): argmax agreement, mean and max |Δlogit|."""
    return logits_agreement(all_logits(reference, sequences), all_logits(model, sequences))


def perplexity_of(logits: torch.Tensor, token_ids: Sequence[int]) -> float:
    """exp(mean -log p(token | the tokens before it)) over ``token_ids[1:]``, from the logits
    [len, vocab] computed on ``token_ids`` (by any model, llama.cpp's too)."""
    target = torch.tensor(list(token_ids)[1:])
    nll = torch.nn.functional.cross_entropy(logits[:-1].double(), target)
    return math.exp(float(nll))


@torch.inference_mode()
def perplexity(model, token_ids: Sequence[int]) -> float:
    """exp(mean -log p(token | the tokens before it)) over ``token_ids[1:]``."""
    from minillm.model_runner import prompt_logits

    return perplexity_of(prompt_logits(model, list(token_ids)), token_ids)


def read_bandwidth_gbps(mbytes: int = 256, repeats: int = 5) -> float:
    """GB/s of one pass that reads ``mbytes`` of float32 (a sum over a fresh tensor: no cache
    holds it), best of ``repeats``: the memory speed a decode step's weight reads can reach."""
    x = torch.ones(mbytes * 2**20 // 4)
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def step_times(models: dict, batch: int, rounds: int = 5, context: int = 128) -> dict[Any, list[float]]:
    """Seconds of one decode step of ``batch`` requests (each after ``context`` cached tokens),
    every model once per round, in turn: per model, one median-of-3 time per round."""
    from minillm.bench.spec_measure import forward_cost
    from minillm.model_runner import ModelRunner

    runners = {}
    for key, m in models.items():
        blocks = batch * -(-(context + 1) // 16)
        runners[key] = ModelRunner(m, m.cfg, blocks, 16, torch.device("cpu"), torch.float32)
    times: dict[Any, list[float]] = {k: [] for k in models}
    for _ in range(rounds):
        for key, r in runners.items():
            times[key].append(forward_cost(r, [1], context=context, batch=batch)[1])
    return times


def main(argv: list[str] | None = None) -> int:
    from minillm import loader
    from minillm.bench.prompts import INSTRUCTIONS
    from minillm.quantization import weight_bytes_per_step

    p = argparse.ArgumentParser(prog="python -m minillm.bench.quant_measure", description=__doc__.split("\n")[0])
    p.add_argument("--schemes", default="int8,q4,int8_channel",
                   help="what to compare with float32: int8, q4, int8_channel (int8 with one scale per row)")
    p.add_argument("--batches", default="1,8,32", help="decode batch sizes to time")
    p.add_argument("--rounds", type=int, default=5, help="alternated rounds of step timing")
    p.add_argument("--prompts", type=int, default=8, help="instruction prompts for teacher forcing")
    p.add_argument("--llamacpp", action="store_true",
                   help="also llama.cpp's logits on the same sequences, from the same GGUF (make peer-llamacpp)")
    args = p.parse_args(argv)
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    tok = loader.load_tokenizer()
    weights = loader.load_weights()
    models = models_for(weights, [None, *schemes], attention_backend="cpu")
    ref = models[None]
    # teacher forcing on the float model's own greedy continuation of each prompt
    from minillm import LLM, SamplingParams

    llm = LLM(engine="continuous", device="cpu", dtype="float32", max_model_len=512)
    prompts = [llm.chat_prompt([{"role": "user", "content": q}]) for q in INSTRUCTIONS[:args.prompts]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=64))
    sequences = [list(p) + list(o.token_ids) for p, o in zip(prompts, outs)]
    held = tok(HELDOUT_TEXT).input_ids
    print(f"{'weights':12s} {'MB stored':>9s} {'argmax agree':>12s} {'mean|dlogit|':>12s} {'max|dlogit|':>11s} "
          f"{'perplexity':>10s}")
    theirs = None
    if args.llamacpp:
        from minillm.bench.llamacpp_runner import llamacpp_logits

        theirs = llamacpp_logits([*sequences, held], gguf_path=loader.find_gguf(), threads=torch.get_num_threads())
    ref_logits = all_logits(ref, sequences)  # once; each model's logits below once too
    against_llamacpp = {}
    for key, m in models.items():
        mine = ref_logits if key is None else all_logits(m, sequences)
        q = logits_agreement(ref_logits, mine)
        print(f"{key or 'float32':12s} {weight_bytes_per_step(m) / 1e6:9.1f} {q['argmax_agreement']:12.2%} "
              f"{q['mean_abs_dlogit']:12.4f} {q['max_abs_dlogit']:11.3f} {perplexity(m, held):10.2f}")
        if theirs is not None and key in ("q4", "int8"):
            against_llamacpp[key] = logits_agreement(mine, theirs[:-1])
        del mine
    if theirs is not None:
        q = logits_agreement(ref_logits, theirs[:-1])
        print(f"{'llama.cpp':12s} {'(gguf)':>9s} {q['argmax_agreement']:12.2%} {q['mean_abs_dlogit']:12.4f} "
              f"{q['max_abs_dlogit']:11.3f} {perplexity_of(theirs[-1], held):10.2f}")
        for key, q in against_llamacpp.items():
            print(f"  llama.cpp against minillm {key}: argmax agreement {q['argmax_agreement']:.2%}, "
                  f"mean |dlogit| {q['mean_abs_dlogit']:.4f}")
    bw = read_bandwidth_gbps()
    print(f"\nread bandwidth: {bw:.1f} GB/s; decode step, context 128, {args.rounds} alternated rounds (median):")
    for b in [int(x) for x in args.batches.split(",")]:
        times = step_times(models, b, rounds=args.rounds)
        base = statistics.median(times[None])
        for key, m in models.items():
            t = statistics.median(times[key])
            floor = weight_bytes_per_step(m, streamed=True) / (bw * 1e9)  # what the CPU kernels read
            print(f"  B={b:<3d} {key or 'float32':12s} {t * 1e3:7.2f} ms  floor {floor * 1e3:6.2f} ms "
                  f"({t / floor:4.1f}x floor)  {base / t:4.2f}x float32's speed  "
                  f"[{min(times[key]) * 1e3:.2f}-{max(times[key]) * 1e3:.2f} ms]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["HELDOUT_TEXT", "models_for", "teacher_forced", "perplexity", "read_bandwidth_gbps", "step_times"]
