"""Short graded questions, a few per chapter: choice or numeric answers.

A learner answers in the chapter's exercise file (``quiz_answers()`` returns a dict
question id -> answer) and ``make grade`` checks each answer. The right answers are not
stored in plain text anywhere, ``solutions/`` included: each question keeps a salted
SHA-256 digest of its normalised answer, and the reference answers are those digests
(``sealed``), so reading the code does not give them away (a determined reader can still try
every choice; the point is that the answer is not printed before the question).
tests/test_quiz.py searches everything a learner reads for a right answer in plain text.

Normalisation: a choice is one letter ("b", "B" or "(b)" all read as "b"); a number is
rounded to the question's ``decimals`` and written with that many decimals, so 9.96 and
10.0 are the same answer at ``decimals=1``.

    >>> from minillm.course import quiz
    >>> quiz.show("ch03")                          # the questions, in a notebook or a shell
    >>> quiz.check("ch03", "q1", 3)                # (True, "q1: correct")
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

_SALT = "minillm-quiz-v1"


@dataclass(frozen=True)
class Question:
    qid: str
    text: str
    digest: str
    choices: tuple[str, ...] = ()  # a choice question when not empty: answer with a letter
    decimals: int | None = None  # a numeric question: rounded to this many decimals

    @property
    def kind(self) -> str:
        return "choice" if self.choices else "numeric"


def normalise(question: Question, answer: Any) -> str:
    """The canonical text of ``answer`` for ``question``; ValueError saying what to write instead."""
    if question.choices:
        if not isinstance(answer, str):
            raise ValueError(f"{question.qid} is a choice question: answer with a letter such as 'b', "
                             f"got {answer!r}")
        letter = answer.strip().strip("()").strip().lower()
        valid = "abcdefgh"[:len(question.choices)]
        if len(letter) != 1 or letter not in valid:
            raise ValueError(f"{question.qid}: answer with one of {', '.join(valid)}, got {answer!r}")
        return letter
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not math.isfinite(answer):
        raise ValueError(f"{question.qid} is a numeric question: answer with a number, got {answer!r}")
    d = question.decimals or 0
    value = round(float(answer), d) + 0.0  # + 0.0 turns -0.0 into 0.0
    return f"{value:.{d}f}"


def digest(chapter: str, qid: str, canonical: str) -> str:
    return hashlib.sha256(f"{_SALT}:{chapter}:{qid}:{canonical}".encode()).hexdigest()[:20]


class Sealed(str):
    """A reference answer kept as its digest: ``check`` compares it with the question's digest.

    ``solutions/`` answers the questions this way (``sealed("ch02")``), so no right answer is
    stored anywhere in plain text; a learner's answer is a letter or a number as usual."""


def sealed(chapter: str) -> dict[str, Sealed]:
    """The reference answers of ``chapter``'s questions, as digests: {"q1": Sealed(...), ...}."""
    return {q.qid: Sealed(q.digest) for q in questions(chapter)}


def _q(qid: str, text: str, digest_: str, choices: tuple[str, ...] = (), decimals: int | None = None) -> Question:
    return Question(qid, " ".join(text.split()), digest_, choices, decimals)


QUIZZES: dict[str, list[Question]] = {
    "ch00": [
        _q("q1", """A decode step at batch 1 reads every weight once. A model of 135,000,000 parameters
            in bf16 (2 bytes each), on a machine that reads memory at 27 GB/s (27e9 bytes/s): what is the
            floor of one decode step, in milliseconds? (1 decimal)""", "d289c53d400febfc7dc3", decimals=1),
        _q("q2", """Why does a decode step of 8 requests cost little more than a step of 1 on this model?""",
           "f79ef2d27590547d1071",
           ("attention over 8 rows is cheaper than over 1",
            "the weights are read once per step and shared by every row, and reading them is most of the step",
            "8 requests fit in the CPU's 8 threads",
            "the KV cache of 8 requests is smaller than that of 1")),
        _q("q3", """Another Llama model has 24 layers, 4 KV heads and head_dim 64. How many bytes of KV cache
            does one token take in bfloat16 (keys and values, every layer)?""", "9d7fd36373b57d6e24dc",
           decimals=0),
        _q("q4", """With temperature 0 the sampler returns""", "7c02c31e139858fb35b9",
           ("a token drawn from softmax(logits)", "a token drawn uniformly from the top-p set",
            "the token with the largest logit", "the most frequent token of the prompt")),
    ],
    "ch01": [
        _q("q1", """Static batching, B = 4, eight requests in arrival order with output lengths
            [10, 2, 2, 2, 50, 3, 3, 4] (one decode step gives each running request one token, and a group
            runs until its longest request is done). How many decode steps does it take?""",
           "be3a3451b66abbbc6db2", decimals=0),
        _q("q2", """For the run of q1, what share of the 4 x steps token-slots carried a needed token? (2 decimals)""",
           "ff81ac38aee3fd9ee4d0", decimals=2),
        _q("q3", """Why are prompts padded on the left in a static batch?""", "d61e26f7f3ba426a3bcc",
           ("so every row's next token is produced at the same column, the last one",
            "so the attention mask can be dropped",
            "so shorter prompts are computed first",
            "because the tokenizer adds its BOS token on the left")),
        _q("q4", """The barrel effect of static batching grows with""", "2ae91265ad84b0e7ca78",
           ("the number of layers", "the vocabulary size", "the prompt length alone",
            "the spread of output lengths within a group")),
    ],
    "ch02": [
        _q("q1", """Continuous batching, B = 2, five requests that want [4, 1, 1, 1, 1] tokens, all waiting at
            the start. Every step each running request gets one token and a finished request's slot is refilled
            at the next step. How many steps does it take?""", "da7bd8d2c021be4e32ad", decimals=0),
        _q("q2", """The same five requests under static batching with B = 2 (groups in arrival order): how many
            steps?""", "4192e892dcad7290fee3", decimals=0),
        _q("q3", """On which workload does continuous batching gain least over static batching?""",
           "29b1828ef5fc08864900",
           ("every request wants the same number of tokens", "one long answer in every eight",
            "chat traffic with long-tailed answer lengths", "requests that arrive one by one over time")),
        _q("q4", """What does continuous batching do to time to first token on a skewed workload?""",
           "2c525b279e6ab3a62a88",
           ("nothing: TTFT depends only on the prompt",
            "it rises: admitting requests slows every step",
            "it falls: a request waits for a free slot, not for a whole group to finish",
            "it falls only when the batch is larger")),
    ],
    "ch03": [
        _q("q1", """How many 16-token blocks does a request of 33 tokens need?""", "ff0eaa1c9e7ce3507a72",
           decimals=0),
        _q("q2", """Block size 16, block table [7, 2, 9]: which cache slot holds the token at position 20?""",
           "631ea5961e3bb5184c6a", decimals=0),
        _q("q3", """A contiguous cache reserves 2048 token slots per request; a request uses 300. What share of
            its reservation is wasted? (2 decimals)""", "9958e453f128320e23f6", decimals=2),
        _q("q4", """When the paged scheduler preempts a request (recompute), its KV blocks are""",
           "1cd48cf293c847ab06c9",
           ("freed; its prompt and generated tokens are prefilled again when it resumes",
            "copied to host memory and copied back on resume",
            "kept, and the request only loses its batch slot",
            "shared with the request that needed them")),
    ],
    "ch04": [
        _q("q1", """Token budget 64 per step, 10 requests decoding (one token each), one waiting prompt of 200
            tokens. How many prompt tokens does the chunked scheduler feed this step?""",
           "e929e1563734e4ea69a0", decimals=0),
        _q("q2", """Same situation, and it stays the same every step (10 decodes, budget 64): how many steps
            does the 200-token prompt take to prefill?""", "44cb1ea6439b710f5671", decimals=0),
        _q("q3", """Chunked prefill lowers mainly""", "a9a2cd91be345ba77028",
           ("the inter-token latency of the requests already decoding", "the TTFT of the long prompt",
            "the number of KV blocks used", "the number of forward passes")),
        _q("q4", """Raising the token budget, with the traffic unchanged,""", "0df2c9d8927475bd0d99",
           ("lowers p99 ITL and raises TTFT of long prompts", "changes neither",
            "lowers TTFT of long prompts and raises p99 ITL", "raises both")),
    ],
    "ch05": [
        _q("q1", """Each draft is accepted with probability 0.8, independently, k = 4. How many tokens does a
            verification step emit on average? (2 decimals)""", "a13db86585944d55b326", decimals=2),
        _q("q2", """Target p = [0.5, 0.3, 0.2], draft q = [0.2, 0.3, 0.5]. What is the acceptance rate
            sum_x min(p(x), q(x))? (2 decimals)""", "12e9cf508e2062b15f5d", decimals=2),
        _q("q3", """alpha = 0.8, k = 4, a draft step costs 0.1 of a target decode step and the verify forward
            costs 1.2 of one. What is the speedup over plain decoding? (2 decimals)""",
           "2095b710a839d3999b29", decimals=2),
        _q("q4", """Speculation stops paying when""", "fbf92f563e28a2a7ce6e",
           ("the prompt is long", "the temperature is above 0", "the drafter is a smaller model",
            "the batch is large enough that the step is bound by compute, so verifying k + 1 tokens costs "
            "about k + 1 steps")),
    ],
    "ch06": [
        _q("q1", """Prefix caching, blocks of 16 tokens. A prompt of 64 tokens was served before and all 4 of its
            blocks are still cached. The same prompt arrives again: how many of its tokens does the engine
            compute?""", "c4e451698beda7caf09c", decimals=0),
        _q("q2", """Eight requests, each a 200-token system prompt (the same for all) followed by a 40-token
            question of its own (the questions differ from their first token); blocks of 16 tokens, caching on,
            all eight admitted one after the other in the same step. What is the prefix-cache hit rate, hit
            tokens over prompt tokens? (2 decimals)""", "be5d7f774c65f7492a08", decimals=2),
        _q("q3", """Caching on, the plain free list is empty. The evictable pool holds the blocks of conversation X,
            which finished a minute ago, then those of conversation Y, which finished just now (a finishing
            request frees its blocks last block first). A new request needs one block: which one does the
            allocator take?""", "6dc600be487e04175f96",
           ("X's last block", "X's first block", "Y's last block",
            "none: a block that can still be hit is never reused, so the request waits")),
        _q("q4", """Priority scheduling, queue timeouts interactive 0.05 s, standard 0.2 s, batch 1 s. At 2.0 s
            the queue holds, in arrival order, b (batch, arrived at 0.5 s), s (standard, arrived at 1.9 s) and i
            (interactive, arrived at 1.99 s). With room for all three, in which order are they admitted?""",
           "7aaf2b2d8d3c84579498", ("i, s, b", "b, s, i", "b, i, s", "i, b, s")),
    ],
    "ch07": [
        _q("q1", """Why does this chapter's load generator send requests open-loop (Poisson arrivals) rather than
            from N clients that each wait for their answer?""", "1602e04649bd5391fd75",
           ("an open loop needs fewer connections to the server",
            "a closed loop slows its own arrivals down when the server slows down, so the queue that independent "
            "users would build never forms and the latency under load looks better than it is",
            "an open loop is the only way to stream tokens",
            "a closed loop sends every request at once")),
        _q("q2", """A sweep measures the median TTFT at offered rates 0.5, 1, 2, 3 and 4 requests/s:
            0.20, 0.22, 0.35, 0.55 and 2.1 s. With the chapter's rule (the knee is the lowest rate whose median
            TTFT is more than twice its value at the lowest rate), where is the knee, in requests/s?
            (1 decimal)""", "5313e37429f632d9ba0d", decimals=1),
        _q("q3", """A 10 s run: 24 requests sent, 2 rejected (HTTP 429), 22 finished. Of the finished ones, 14
            met TTFT <= 1 s and TPOT <= 0.2 s, 5 had a TTFT over 1 s and 3 a TPOT over 0.2 s. The throughput is
            2.2 requests/s; what is the goodput, in requests/s? (1 decimal)""", "0a2ec67a3fe15125f950",
           decimals=1),
        _q("q4", """The SLO controller measures a p95 inter-token latency above its target. What does it do, and
            why does that help?""", "b91cec11c45d8b22b57b",
           ("it raises the token budget, so waiting prompts finish their prefill in fewer steps",
            "it rejects new requests until the p95 is back under the target",
            "it cuts the token budget (multiplicatively): prompt chunks get smaller, each step is shorter, and "
            "the running decodes wait less between their tokens",
            "it keeps the budget: a p95 over the target is normal under load")),
    ],
    "ch08": [
        _q("q1", """A step verifies a Medusa tree of 16 choices (``MEDUSA_TREE``) for each of 4 requests, in one
            forward. How many query rows does that forward hold for them, each tree's root (the request's last
            known token) included?""", "72988b02e246f0383f8b", decimals=0),
        _q("q2", """After a node of the tree the target gives token a probability 0.40, b 0.25, c 0.20 and d
            0.15. The node's children hold c and a, tried in that order. With the exact rule (multi-candidate
            rejection sampling), what is the probability that the walk moves into the child that holds a?
            (2 decimals)""", "700ea2e9baf16a4190be", decimals=2),
        _q("q3", """Medusa-2's typical acceptance accepts more candidates than the exact rule. Why are the tokens
            it samples not distributed as the target's?""", "d97e933837687fe555d2",
           ("it compares the candidates with the heads' probabilities instead of the target's",
            "a candidate that clears its threshold is taken with probability 1 where the target would emit it "
            "with probability p(x) < 1, and where the walk stops it samples p with the rejected candidates "
            "still in it",
            "its threshold depends on the entropy, which the engine computes in low precision",
            "it is exact too: only greedy decoding differs")),
        _q("q4", """A tree of three choices, (0,), (1,) and (0, 0). At the root, head 0's top-1 is the target's
            next token with probability 0.45 and its second-ranked token with probability 0.25; at node (0,),
            head 1's top-1 is the target's next token with probability 0.6. With the exact rule, how many tokens
            does one verification emit on average? (2 decimals)""", "721ce3fe61717ee0efc0", decimals=2),
    ],
    "ch09": [
        _q("q1", """SmolLM2-1.7B has 24 layers, 32 KV heads and head_dim 64. The host tier copies whole KV
            blocks of 16 tokens, keys and values of every layer, in bfloat16. How many bytes does offloading
            one block copy?""", "f34cf3e759974730150a", decimals=0),
        _q("q2", """A returning user's prefix is found in the host tier: its blocks are copied back to the device
            instead of being recomputed. Why does the copy take less time than recomputing?""",
           "9db9973bc3085661ccc1",
           ("host memory is faster than device memory, so K/V read from it arrive sooner",
            "recomputing runs every prefix token through every layer (about 2 x 135 million FLOPs a token, plus "
            "attention over the tokens before it), while the copy moves only that token's K/V, tens of kilobytes",
            "a restored block needs no attention in the steps that follow",
            "recomputing the prefix would change the greedy tokens, so it must be avoided")),
        _q("q3", """The SLO controller keeps the budget while a p95 lies between headroom x its target and its
            target (the hysteresis band). What does that band prevent?""", "f15b5021e2edb717fb7d",
           ("the budget falling below max_num_seqs, one step's decodes",
            "a cut when the p95 ITL is over its target",
            "oscillation: raising whenever a p95 is just under its target would push it over at the next "
            "interval and bring a cut, so the budget would swing up and down at every decision",
            "the TTFT window counting the requests that still wait for their first token")),
        _q("q4", """An A/B of two servers on the same trace gives, for TTFT p95, a 95% percentile-bootstrap
            interval of B - A of [-40 ms, +25 ms]. What can you conclude?""", "2ecc2b3dfd40e7cf0d03",
           ("B is better: most of the interval lies below 0",
            "the two servers have the same TTFT p95",
            "B is worse with probability 95%",
            "no difference was detected at 95%: the data fit B anywhere from 40 ms faster to 25 ms slower, "
            "which is not proof that the two are the same")),
    ],
    "ch10": [
        _q("q1", """SmolLM2-135M (30 layers, hidden size 576) runs on 2 ranks and prefills a prompt of 100 tokens
            in bfloat16 (2 bytes an element). With the chapter's two all-reduces a layer, how many bytes does each
            rank all-reduce in that forward?""", "4552f8e63cc2678abba0", decimals=0),
        _q("q2", """A Llama block is cut Megatron-style. Which projections are column-parallel (each rank holds some
            of their output features)?""", "357a2f2b88fb6cac6742",
           ("o_proj and down_proj",
            "q_proj, k_proj, v_proj, gate_proj and up_proj",
            "every projection of the block",
            "only those whose output features divide evenly by the number of ranks")),
        _q("q3", """Why does the MLP need one all-reduce, after down_proj, and none between gate/up and down?""",
           "ec82053de5a249a78ff3",
           ("a second all-reduce, after gate/up, would give the same output: the engine skips it to save time",
            "SiLU is linear, so each rank can apply it to partial sums and the one sum after down_proj still gives "
            "the right output",
            "gate and up are split by output feature, so each rank computes SiLU(gate) * up on whole features of "
            "its own; down is split by input feature, so each rank's output is a partial sum that one sum completes",
            "down_proj is replicated on every rank, so each rank computes the whole output from the gathered "
            "intermediate features")),
        _q("q4", """At the same batch, going from tensor_parallel_size=2 to 4, what happens per rank in a decode
            step?""", "8b90bdd3a26586bc3bfd",
           ("the projection weights it holds and reads halve, while the size of the tensors it all-reduces stays "
            "the same",
            "both halve: each rank all-reduces only its own slice of the output",
            "the projection weights it holds and reads halve, and the size of the tensors it all-reduces doubles",
            "neither changes: every rank still reads the whole model")),
    ],
    "ch11": [
        _q("q1", """A 4-bit format stores weights in groups of 64, each group with a float32 scale and a float32
            minimum. How many bits does a decode step read per weight? (1 decimal)""", "f89d57c79db95056dd98",
           decimals=1),
        _q("q2", """A model of 1,000,000,000 weights is stored in 4-bit groups of 32 with a float16 scale and a
            float16 minimum per group (the layout of GGUF's Q4_1). The memory reads 25 GB/s. What is the floor of
            a batch-1 decode step, in milliseconds? (1 decimal)""", "43bf36495d2a17110dd6", decimals=1),
        _q("q3", """4-bit weights make a batch-1 decode step about three times faster than float32 weights on a
            CPU, but at batch 32 most of the gain is gone. Why?""", "efa128b4bedf77378fe6",
           ("at batch 32 the kernels fall back to the float32 weights",
            "a step at batch 32 is no longer bound by reading the weights: its multiply-adds grow with the batch "
            "while the bytes of weights it reads do not",
            "the KV cache is quantized too, and at batch 32 it is most of the bytes",
            "quantization changes the tokens at large batch, so more steps are needed")),
        _q("q4", """The projections are 4-bit, but the LM head keeps 8-bit symmetric groups. Why?""",
           "21e53f18a62da513b888",
           ("the head is too small for 4 bits to save anything",
            "a 4-bit kernel cannot multiply 49,152 rows",
            "the head's logits pick the token directly: 4 bits there change the argmax at many more positions, "
            "and 8-bit symmetric groups of 32 hold the GGUF's own 8-bit embedding exactly",
            "the head is read only at prefill, so its bytes do not count")),
    ],
}


def questions(chapter: str) -> list[Question]:
    key = chapter[:4]
    if key not in QUIZZES:
        raise ValueError(f"no questions for chapter {chapter!r}; chapters with questions: {', '.join(QUIZZES)}")
    return QUIZZES[key]


def question(chapter: str, qid: str) -> Question:
    for q in questions(chapter):
        if q.qid == qid:
            return q
    raise ValueError(f"chapter {chapter[:4]} has no question {qid!r}; "
                     f"questions: {', '.join(q.qid for q in questions(chapter))}")


def check(chapter: str, qid: str, answer: Any) -> tuple[bool, str]:
    """(correct, one line saying so or why not) for one answer."""
    q = question(chapter, qid)
    if answer is None:
        return False, f"{qid}: not answered (add {qid!r} to the dict quiz_answers() returns)"
    if isinstance(answer, Sealed):
        return (True, f"{qid}: correct") if answer == q.digest else (False, f"{qid}: the sealed answer is not this question's")
    try:
        canonical = normalise(q, answer)
    except ValueError as e:
        return False, str(e)
    if digest(chapter[:4], qid, canonical) == q.digest:
        return True, f"{qid}: correct"
    hint = f" (rounded to {q.decimals} decimals: {canonical})" if q.kind == "numeric" else ""
    return False, f"{qid}: {answer!r} is not the answer{hint}"


def show(chapter: str) -> str:
    """The chapter's questions as text (printed, and returned)."""
    lines = [f"Questions for {chapter[:4]} (answer in quiz_answers() of the chapter's exercise file):", ""]
    for q in questions(chapter):
        lines.append(f"{q.qid}. {q.text}")
        if q.choices:
            lines += [f"    ({'abcdefgh'[i]}) {c}" for i, c in enumerate(q.choices)]
        else:
            lines.append(f"    [a number{'' if not q.decimals else f', {q.decimals} decimals'}]")
        lines.append("")
    text = "\n".join(lines).rstrip()
    print(text)
    return text
