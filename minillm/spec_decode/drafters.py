"""Drafters: who proposes the k tokens the target verifies.

Each answers one call per engine step, for the requests that decode this step:

    propose(requests, limits) -> (drafts, draft_probs)

``drafts[i]`` holds at most ``limits[i]`` token ids for ``requests[i]``; ``draft_probs[i]``
is ``[len(drafts[i]), V]``, the exact distribution each draft was sampled from (the q of
the rejection rule), or None for a deterministic drafter (q = one-hot).

* ``NgramDrafter``: prompt lookup (``ngram.NgramProposer``): no model, no memory.
* ``ModelDrafter``: a small causal LM with the target's vocabulary, run autoregressively
  k times over all drafting requests at once, with its own paged KV cache. A cheap way
  to get one without a second checkpoint is a *self-draft*: the target's own embeddings,
  final norm and head over a subset of its layers (``layer_subset_model``).
* ``MedusaDrafter``: Medusa heads (``medusa.MedusaHeads``) on the target's own final
  hidden state of each request's last sampled row: head k's top-1 is draft k, all heads
  in one call. No model of its own, no KV cache; the speculator hands it each step's
  hidden states (``observe``).

After verification the engine calls ``rollback(request)``: the drafter's K/V for rejected
drafts is stale, so its per-request computed length is cut back to the target's.
"""
from __future__ import annotations

import copy
import os

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from ..config import ModelConfig, SpeculativeConfig
from ..model_runner import ModelRunner
from ..request import Request
from ..sampling import sample_from_probs_at
from ..sampling_params import SamplingParams
from ..scheduler.output import ScheduledRequest, SchedulerOutput
from .ngram import NgramProposer
from .rejection_sampler import draft_probs_from_logits

Proposal = tuple[list[list[int]], list[torch.Tensor] | None]


class NgramDrafter:
    """Prompt lookup over prompt + output; q is the one-hot of each proposal."""

    deterministic = True

    def __init__(self, n_min: int = 1, n_max: int = 3):
        self.proposer = NgramProposer(n_max=n_max, n_min=n_min)
        self.num_forwards = 0  # no model: never any draft forward

    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> Proposal:
        return [self.proposer.propose(r.all_token_ids, k) if k > 0 else [] for r, k in zip(requests, limits)], None

    def rollback(self, request: Request) -> None:
        pass

    def forget(self, request: Request) -> None:
        pass


def layer_subset_model(target: nn.Module, layers: Sequence[int]) -> nn.Module:
    """A Llama made of ``target``'s layers ``layers`` (in order), sharing every weight.

    The embeddings, the final norm and the LM head are the target's, so the draft costs
    no memory but its own KV cache. Skipping layers makes hidden states the head was
    not trained on: how good such a draft is has to be measured, not assumed.
    """
    from ..model import Llama

    n = target.cfg.num_layers
    bad = [i for i in layers if not 0 <= i < n]
    if bad:
        raise ValueError(f"draft_layers {bad} are not layers of the target, which has layers 0..{n - 1}")
    cfg = dataclasses.replace(target.cfg, num_layers=len(layers))
    with torch.device("meta"):  # no weights allocated: every module is replaced below
        draft = Llama(cfg, target.attention_backend)
    draft.embed, draft.norm, draft.lm_head = target.embed, target.norm, target.lm_head
    draft.packed_head = getattr(target, "packed_head", None)
    draft.quantized_head = getattr(target, "quantized_head", None)
    draft.layers = nn.ModuleList(target.layers[i] for i in layers)
    return draft


def check_same_vocab(target_cfg: ModelConfig, draft_cfg: ModelConfig) -> None:
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary has {draft_cfg.vocab_size} tokens but the target's has "
            f"{target_cfg.vocab_size}: a draft must share the target's tokenizer, or its token ids "
            "mean other text and the target would verify nonsense")


@dataclass(slots=True, eq=False)
class DraftSequence:
    """What the draft model has cached for one request (the shape ``build_batch`` reads)."""

    all_token_ids: list[int]  # context + drafts of the current step
    num_computed_tokens: int  # tokens with K/V in the *draft* cache
    block_ids: list[int]  # the target's block table (the same list): both caches share the paging
    num_preemptions: int  # the request's count when this state was made: a preemption resets it
    sampling_params: SamplingParams | None = None  # the request's: they travel in each draft step's upload

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class ModelDrafter:
    """A causal LM drafting k tokens per request, sampled under each request's SamplingParams.

    A draft for position p of a request is argmax(q_p / E_p) with E_p the very noise the
    target will use for that position (``sampling.position_noise``): where q_p is close to
    p_p the draft is the token the target itself samples, and verification
    (``rejection_sampler.coupled_verify``) keeps it.

    Its KV cache has the same block geometry as the target's and is indexed through the
    target's block tables: the engine reserves blocks for the drafts before drafting, the
    draft model writes positions the target will overwrite when it verifies, and when
    rejected tokens' blocks are freed the draft forgets them too (``rollback``).
    """

    deterministic = False

    def __init__(self, model: nn.Module, target_cfg: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype):
        check_same_vocab(target_cfg, model.cfg)
        self.model = model
        self.runner = ModelRunner(model, model.cfg, num_blocks, block_size, device, dtype)
        self.state: dict[Request, DraftSequence] = {}
        self.num_forwards = 0

    def _sequence(self, r: Request) -> DraftSequence:
        seq = self.state.get(r)
        if seq is None or seq.num_preemptions != r.metrics.num_preemptions:
            # new, or preempted since: its blocks were freed, the cached K/V is gone
            seq = self.state[r] = DraftSequence([], 0, r.block_ids, r.metrics.num_preemptions)
        seq.all_token_ids = r.all_token_ids
        seq.block_ids = r.block_ids
        seq.sampling_params = r.sampling_params
        return seq

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> Proposal:
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = [i for i, k in enumerate(limits) if k > 0]
        seqs = {i: self._sequence(requests[i]) for i in active}
        while active:
            # Each forward feeds what the draft cache lacks: at first the tokens verified
            # last step (or the whole context of a request new to the drafter), then the
            # previous draft. Every row samples.
            rows = [ScheduledRequest(seqs[i], seqs[i].num_tokens - seqs[i].num_computed_tokens) for i in active]
            step = self.runner.execute(SchedulerOutput(rows))  # its upload carries the rows' parameters
            logits = step.logits  # [A, V]
            self.num_forwards += 1
            params = [requests[i].sampling_params for i in active]
            q = draft_probs_from_logits(logits[:, None], params, step.sampling_table)[:, 0]  # [A, V]: what we sample from
            tokens = q.argmax(dim=-1)  # greedy rows: q is one-hot
            sampled = [j for j, p in enumerate(params) if not p.greedy]
            if sampled:  # with the noise of the position the draft lands at, shared with the target
                reqs = [requests[active[j]] for j in sampled]
                drawn = sample_from_probs_at(torch.stack([q[j] for j in sampled]), [r.seed for r in reqs],
                                             [seqs[active[j]].num_tokens for j in sampled],
                                             [r.generator for r in reqs])
                for n, j in enumerate(sampled):  # host integers: no index tensor to upload
                    tokens[j] = drawn[n]
            for j, (i, t) in enumerate(zip(active, tokens.tolist())):
                seqs[i].num_computed_tokens = seqs[i].num_tokens
                seqs[i].all_token_ids.append(t)
                drafts[i].append(t)
                probs[i].append(q[j])
            active = [i for i in active if len(drafts[i]) < limits[i]]
        # The last draft of each row was sampled, never fed: the draft cache stops before it.
        V = self.model.cfg.vocab_size
        empty = torch.zeros(0, V, device=self.runner.device)
        return drafts, [torch.stack(p) if p else empty for p in probs]

    def rollback(self, request: Request) -> None:
        """Keep the draft K/V of verified tokens only: never more than the target has computed."""
        seq = self.state.get(request)
        if seq is not None:
            seq.num_computed_tokens = min(seq.num_computed_tokens, request.num_computed_tokens)

    def forget(self, request: Request) -> None:
        self.state.pop(request, None)


class MedusaDrafter:
    """A chain of Medusa drafts: for a request whose last token t was sampled from the
    target's hidden state h (the state at the position before t), head k's argmax on h
    is the token k + 1 after t. q is one-hot (deterministic).

    With a ``tree`` (``spec_decode/tree.py`` TreeSpec) the drafts are the tree's nodes
    instead, node n taking rank ranks[n] of head depths[n] - 1's ranking; a request with
    room for fewer drafts gets the tree's first nodes (``TreeSpec.prefix``)."""

    deterministic = True

    def __init__(self, heads: Any, tree: Any = None):
        self.heads = heads
        self.tree = tree
        self.hidden: dict[Request, torch.Tensor] = {}  # request -> the hidden state its last token came from
        self.num_forwards = 0  # calls of the heads (one per step that drafts)

    def observe(self, requests: Sequence[Request], rows: Sequence[int], hidden: torch.Tensor | None) -> None:
        """After a step: ``hidden[rows[i]]`` is the state ``requests[i]``'s last emitted token was
        sampled from. Without hidden states the old ones are stale: dropped (no drafts until the next)."""
        for r, j in zip(requests, rows):
            if hidden is None:
                self.hidden.pop(r, None)
            else:
                self.hidden[r] = hidden[j]

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> Proposal:
        drafts: list[list[int]] = [[] for _ in requests]
        live = [j for j, (r, k) in enumerate(zip(requests, limits)) if k > 0 and r in self.hidden]
        if live:
            k_max = max(limits[j] for j in live)
            states = torch.stack([self.hidden[requests[j]] for j in live])  # [N, hidden]
            if self.tree is None:
                tokens = self.heads(states, heads=range(k_max)).argmax(dim=-1).T.tolist()  # [N, k_max]
            else:
                t = self.tree.prefix(min(k_max, self.tree.num_nodes - 1))
                ranking = self.heads(states, heads=range(t.depth)).topk(t.width, dim=-1).indices  # [depth, N, W]
                heads_of = torch.tensor([d - 1 for d in t.depths[1:]], device=ranking.device)
                ranks = torch.tensor(t.ranks[1:], device=ranking.device)
                tokens = ranking[heads_of, :, ranks].T.tolist()  # [N, nodes]: node n's token for every request
            for n, j in enumerate(live):
                drafts[j] = tokens[n][:limits[j]]
            self.num_forwards += 1
        return drafts, None

    def rollback(self, request: Request) -> None:
        pass  # nothing cached past the hidden state ``observe`` set after verification

    def forget(self, request: Request) -> None:
        self.hidden.pop(request, None)


def medusa_heads(spec: SpeculativeConfig, target: nn.Module, device: torch.device, dtype: torch.dtype) -> Any:
    """The heads of ``spec.heads`` (a file, default ``medusa.SHIPPED``, or a ``MedusaHeads``) on
    ``target``'s tied embedding, in the target's device and dtype; ValueError if they do not fit."""
    from .medusa import SHIPPED, MedusaHeads

    embedding = target.embed.weight if target.lm_head is None else target.lm_head.weight
    if isinstance(spec.heads, MedusaHeads):
        heads = spec.heads
        if tuple(heads.embedding.shape) != tuple(embedding.shape):
            raise ValueError(f"the Medusa heads read a [{heads.vocab_size}, {heads.hidden_size}] embedding; "
                             f"the target's is {list(embedding.shape)}")
        own = MedusaHeads(embedding, num_heads=heads.num_heads, hidden_size=heads.hidden_size)
        with torch.no_grad():  # the target's embedding, in its device and dtype; the caller's heads untouched
            own.weight.copy_(heads.weight.detach().float())
            own.bias.copy_(heads.bias.detach().float())
        heads = own
    else:
        path = SHIPPED if spec.heads is None else spec.heads
        if not os.path.isfile(path):
            raise ValueError(f"no Medusa heads file at {path}: train them with `python -m minillm.bench.train_medusa` "
                             f"(it writes {SHIPPED}), or pass speculative={{'method': 'medusa', 'heads': PATH}}")
        heads = MedusaHeads.load(path, embedding)
    if spec.tree is not None:
        if spec.tree.depth > heads.num_heads:
            raise ValueError(f"the tree is {spec.tree.depth} deep but the Medusa heads are {heads.num_heads}: "
                             f"depth d reads head d - 1, so choices of at most {heads.num_heads} ranks")
    elif spec.num_speculative_tokens > heads.num_heads:
        raise ValueError(f"num_speculative_tokens={spec.num_speculative_tokens} but the Medusa heads are "
                         f"{heads.num_heads}: one draft per head, so at most {heads.num_heads}")
    heads = heads.to(device=device, dtype=dtype)
    if spec.quantization:  # after the move: the quantized layers keep their own dtypes
        heads.quantize(spec.quantization, head=getattr(target, "quantized_head", None))
    return heads


def build_drafter(spec: SpeculativeConfig, target: nn.Module, num_blocks: int, block_size: int,
                  device: torch.device, dtype: torch.dtype) -> Any:
    """The drafter ``spec`` asks for, checked against the target (layers, vocabulary); with
    ``spec.draft_process``, that drafter running in a process of its own (``pipeline.DraftProcess``)."""
    if spec.draft_process:
        from .pipeline import DraftProcess

        inner = build_drafter(dataclasses.replace(spec, draft_process=False), target, num_blocks, block_size,
                              device, dtype)
        return DraftProcess(inner, spec.num_speculative_tokens)
    if spec.method == "ngram":
        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "medusa":
        tree = spec.tree
        if tree is None and spec.acceptance == "typical":  # typical acceptance walks trees: the chain as one
            from .tree import chain

            tree = chain(spec.num_speculative_tokens)
        return MedusaDrafter(medusa_heads(spec, target, device, dtype), tree)
    if spec.draft_layers is not None:
        draft = layer_subset_model(target, spec.draft_layers)
    elif isinstance(spec.model, nn.Module):
        if not isinstance(getattr(spec.model, "cfg", None), ModelConfig):
            raise ValueError("a draft model given as a module must be a minillm Llama (with a .cfg ModelConfig)")
        draft = spec.model
    else:
        from .. import loader
        from ..model import build_model

        check_same_vocab(target.cfg, loader.read_config(spec.model))  # before loading any weight
        draft = build_model(loader.read_config(spec.model), loader.load_weights(spec.model), device, dtype,
                            target.attention_backend,
                            pack_weights=getattr(target, "packed_head", None) is not None and not spec.quantization)
    if spec.quantization:
        from ..quantization import quantize_model

        if draft is spec.model:  # the caller's Llama: a new one over its layers, which it keeps as they are
            draft = layer_subset_model(draft, list(range(draft.cfg.num_layers)))
        if spec.draft_layers is not None or spec.model is not None and not isinstance(spec.model, (str, os.PathLike)):
            _own_projections(draft)
        quantize_model(draft, spec.quantization)
    return ModelDrafter(draft, target.cfg, num_blocks, block_size, device, dtype)


def _own_projections(draft: nn.Module) -> None:
    """Give ``draft`` (a ``layer_subset_model``) layers of its own that share everything with the
    layers it was made of, so that quantizing its projections (which replaces modules) leaves
    those layers, the target's, as they are. No weight is copied."""

    def shallow(m: nn.Module) -> nn.Module:
        c = copy.copy(m)
        c._modules, c._parameters, c._buffers = dict(m._modules), dict(m._parameters), dict(m._buffers)
        return c

    layers = []
    for layer in draft.layers:
        own = shallow(layer)
        own.attn, own.mlp = shallow(layer.attn), shallow(layer.mlp)
        layers.append(own)
    draft.layers = nn.ModuleList(layers)


__all__ = ["NgramDrafter", "ModelDrafter", "MedusaDrafter", "medusa_heads", "DraftSequence", "layer_subset_model", "check_same_vocab",
           "build_drafter"]
