"""From "these requests, this many tokens each" to one forward pass and its logits.

The scheduler hands over rows ``(request, num_new_tokens)``. The runner lays the new
tokens of all rows end to end and builds the flat tensors of design.md §2:

    input_ids[T], positions[T], slot_mapping[T],
    block_tables[B, max_blocks], query_start_loc[B+1], context_lens[B]

then runs the model once and computes logits only where a row samples (its last new
token reaches the end of what the request knows).

A row may also carry *drafted* tokens (speculative decoding, ``minillm/spec_decode/``): they
are fed after the known ones, and the row gets logits at its last known token and at
every draft, the k + 1 distributions that verify k drafts in this one forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import seams
from .attention import AttentionMetadata
from .block_manager import slots_for  # token position -> cache slot through a block table
from .config import ModelConfig
from .host_kv import HostKVCache
from .model import forward_seam_plugged
from .request import Request
from .sampling import param_table_bits
from .scheduler.output import ScheduledRequest, SchedulerOutput


@dataclass(slots=True)
class StepBatch:
    """One step's flat inputs (design.md §2), and where its logits go."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_index: torch.Tensor  # [S] indices in [T] of the tokens whose logits are needed
    rows: list[int]  # index in ``out.rows`` of every row that samples, in order
    offsets: list[int]  # where each of those rows' logits start in the [S] logits
    token_starts: list[int]  # where each of those rows' first logits token sits in [T]
    # [S, 3] float64 on the device: the (temperature, top_k, top_p) of every logits row (a
    # row verifying k drafts repeats its own k + 1 times), part of the step's one upload
    # (``sampling.param_table_values``); read by ``compute_probs``.
    sampling_table: torch.Tensor | None = None


@dataclass(slots=True)
class ModelOutput:
    """What one forward hands back: logits laid out as the batch was built.

    Sampling row ``rows[j]`` owns ``logits[offsets[j] : offsets[j] + out.rows[rows[j]].num_logits]``:
    one row of logits, or 1 + its drafts when it verifies drafts.
    """

    logits: torch.Tensor  # [S, V] float32
    rows: list[int]
    offsets: list[int]
    # The step's input_ids [T] on the device, and where each sampling row's first logits
    # token sits in it: a row's drafts are input_ids[start + 1 : start + 1 + k], so the
    # verifier reads them from the device instead of uploading them again.
    input_ids: torch.Tensor | None = None
    token_starts: list[int] | None = None
    sampling_table: torch.Tensor | None = None  # [S, 3] float64, laid out as logits, see StepBatch
    # The final hidden states of the rows with logits [S, hidden], laid out as logits; only
    # when the runner keeps them (``keep_hidden``: Medusa heads draft from them; such a
    # runner does not replay CUDA graphs).
    hidden: torch.Tensor | None = None


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                      dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each [num_blocks, block_size, num_kv_heads, head_dim], all zeros.

    On the CPU the zeros are not written up front (``untouched_zeros``): the default
    cache of SmolLM2 is 3 GB (8 sequences of 8,192 tokens), and writing it took 13 s
    here; the memory of a block is then taken when a token is first written into it.
    """
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    zeros = untouched_zeros if torch.device(device).type == "cpu" else torch.zeros
    return [(zeros(shape, device=device, dtype=dtype), zeros(shape, device=device, dtype=dtype))
            for _ in range(cfg.num_layers)]


def untouched_zeros(shape: tuple[int, ...], device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zero CPU tensor whose pages the process has not touched yet.

    ``torch.zeros`` writes every byte at once. This tensor is a view of an anonymous
    memory map instead, which the operating system hands out as zero pages only when
    each page is first written. A KV cache is mostly never used (it is sized for the
    longest sequences), so it costs neither the time to clear it nor the memory until
    tokens land in it; a first write into a 4 KB page costs microseconds (measured
    here: +0.4 ms per decode step of 8 rows over 60 cache tensors). Huge pages are
    not asked for: faulting in a 2 MB page took milliseconds here, inside a step.
    """
    import mmap

    if torch.device(device).type != "cpu":
        raise ValueError(f"untouched_zeros makes CPU tensors; use torch.zeros on {device}")
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # frombuffer keeps the map alive as long as the tensor; the map is page aligned.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


def kv_cache_bytes(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv_caches)


def build_batch(rows: list[ScheduledRequest], block_size: int, device: torch.device) -> StepBatch:
    """Flat step inputs for ``rows``, built on the host and copied to ``device`` in ONE upload.

    A row that samples gets logits at its last token, or at its last 1 + len(spec_token_ids)
    tokens when it carries drafts (the k + 1 distributions that verify k drafts).

    Every number of the step goes into one host buffer of int64, laid out as
    ``input_ids | positions | slot_mapping | logits_index | query_start_loc | context_lens |
    block_tables | sampling table`` (the sampling rows' temperature, top_k and top_p as the
    bits of float64s, viewed back as float64 on the device); one copy moves it to the device (from pinned memory, without blocking,
    on CUDA) and the tensors the model reads are views of it. Each separate small copy
    costs a launch and, from pageable memory, a wait for the device: a decode step of a
    small model is short enough that a handful of them shows in the step time. The host
    keeps plain lists of the shapes that plan the step (query and context lengths, block
    tables), so no layer has to read them back from the device.
    """
    return batch_from_plan(plan_batch(rows, block_size), device)


@dataclass(slots=True)
class BatchPlan:
    """A step's inputs as plain host numbers: ``build_batch`` before its upload. Small and
    picklable, so it is what a tensor-parallel engine broadcasts to its other ranks
    (``distributed/runner.py``), each of which uploads it to its own device."""

    flat: list[int]  # input_ids | positions | slot_mapping | logits_index | query_start_loc | context_lens | tables | params
    cuts: list[int]  # the lengths of the first six
    width: int  # block-table columns
    block_size: int
    with_table: bool  # the sampling table closes ``flat``
    qlens: list[int]
    ctx: list[int]
    qstart: list[int]
    tables: list[list[int]]
    sample_rows: list[int]
    offsets: list[int]
    token_starts: list[int]
    tree_start: list[int] | None = None  # per token, when a row verifies a candidate tree (AttentionMetadata)
    tree_bits: list[int] | None = None


def plan_batch(rows: list[ScheduledRequest], block_size: int) -> BatchPlan:
    """The host half of ``build_batch``: every number of the step, laid out for one upload."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    qstart = [0]
    ctx: list[int] = []
    qlens: list[int] = []
    logits_index: list[int] = []
    sample_rows: list[int] = []
    offsets: list[int] = []
    trees = any(row.spec_tree is not None for row in rows)
    tree_start: list[int] = []
    tree_bits: list[int] = []
    for i, row in enumerate(rows):
        r, n = row.request, row.num_new_tokens
        start, end = r.num_computed_tokens, r.num_computed_tokens + n
        ids.extend(r.all_token_ids[start:start + row.num_known_tokens])
        ids.extend(row.spec_token_ids)
        tree = row.spec_tree
        if tree is None:
            pos.extend(range(start, end))
            if trees:
                tree_start.extend(range(start + 1, end + 1))  # past each token's own position: no mask
                tree_bits.extend([0] * n)
        else:  # a candidate tree after the root (the last known token): slots in node order,
            root = end - tree.num_nodes  # positions root + depth, each node reading its ancestors
            pos.extend(range(start, root))
            pos.extend(root + d for d in tree.depths)
            tree_start.extend([end] * (root - start) + [root + 1] * tree.num_nodes)
            tree_bits.extend([0] * (root - start) + tree_mask_bits(tree))
        slots.extend(slots_for(r.block_ids, block_size, start, end))
        qstart.append(qstart[-1] + n)
        ctx.append(end)
        qlens.append(n)
        if row.samples:
            sample_rows.append(i)
            offsets.append(len(logits_index))
            logits_index.extend(range(qstart[-1] - row.num_logits, qstart[-1]))
    width = max((len(r.request.block_ids) for r in rows), default=1)
    tables = [r.request.block_ids + [0] * (width - len(r.request.block_ids)) for r in rows]
    T, S, B = len(ids), len(logits_index), len(rows)
    flat = ids + pos + slots + logits_index + qstart + ctx
    for t in tables:
        flat.extend(t)
    # The parameters of every logits row (a drafter's sequences carry their request's; a
    # sequence without any, such as a bare test row, leaves the table out)
    params = [getattr(rows[i].request, "sampling_params", None) for i in sample_rows for _ in range(rows[i].num_logits)]
    with_table = all(p is not None for p in params)
    if with_table:
        flat.extend(param_table_bits(params))
    cuts = [T, T, T, S, B + 1, B]
    return BatchPlan(flat, cuts, width, block_size, with_table, qlens, ctx, qstart, tables, sample_rows, offsets,
                     [qstart[i + 1] - rows[i].num_logits for i in sample_rows],
                     tree_start if trees else None, tree_bits if trees else None)


def tree_mask_bits(tree) -> list[int]:
    """Each node's ancestors-or-self past the root as the bits the attention kernels read
    (``TreeSpec.ancestor_bits``), or from a learner's plugged ``tree_attention_mask`` (chapter 8):
    bit m - 1 set iff mask[n, m], for m = 1..N."""
    mine = seams.plugged("tree_attention_mask")
    if mine is None:
        return tree.ancestor_bits()
    mask = _checked_tree_mask(torch.as_tensor(mine(list(tree.parents)), dtype=torch.bool), tree.num_nodes)
    n = tree.num_nodes
    weights = [1 << (m - 1) for m in range(1, n)]
    return [sum(w for w, seen in zip(weights, row[1:]) if seen) for row in mask.tolist()]


def _checked_tree_mask(mask: torch.Tensor, n: int) -> torch.Tensor:
    """A learner's tree mask, held to what the kernels rely on before it becomes bits: [n, n], every
    node reading itself, and no node reading one numbered after it (its ancestors come before it).
    A ``seams.SeamContractError`` naming the first row that breaks it."""
    def broken(invariant: str, got: str) -> seams.SeamContractError:
        return seams.SeamContractError("tree_attention_mask", invariant, got)

    if mask.shape != (n, n):
        raise broken(f"tree_attention_mask must return [{n}, {n}] for {n} nodes", f"{tuple(mask.shape)}")
    if not bool(mask.diagonal().all()):
        i = int((~mask.diagonal()).nonzero()[0])
        raise broken("every node attends to itself (mask[i, i])", f"mask[{i}, {i}] is False")
    later = mask.triu(1).nonzero()
    if len(later):
        i, j = (int(v) for v in later[0])
        raise broken("a node attends only to itself and its ancestors, which come before it",
                     f"mask[{i}, {j}] is True: node {i} reads node {j}, numbered after it")
    return mask


def batch_from_plan(plan: BatchPlan, device: torch.device) -> StepBatch:
    """The device half of ``build_batch``: one upload, and the step's tensors as views of it."""
    buf = upload(plan.flat, torch.long, device)
    cuts, width, B, S = plan.cuts, plan.width, plan.cuts[5], plan.cuts[3]
    input_ids, positions, slot_mapping, li, qsl, cl = buf[:sum(cuts)].split(cuts)
    end = sum(cuts) + B * width
    bt = buf[sum(cuts):end].view(B, width)
    sampling_table = buf[end:].view(torch.float64).view(S, 3) if plan.with_table else None
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=bt.to(torch.int32),
        query_start_loc=qsl.to(torch.int32),
        context_lens=cl.to(torch.int32),
        block_size=plan.block_size,
        query_lens_list=plan.qlens,
        context_lens_list=plan.ctx,
        query_start_loc_list=plan.qstart,
        block_tables_list=plan.tables,
    )
    if plan.tree_start is not None:  # a step that verifies a candidate tree: its mask, one more small upload
        meta.tree_start = upload(plan.tree_start, torch.int32, device)
        meta.tree_bits = upload(plan.tree_bits, torch.int64, device)
        meta.tree_start_list, meta.tree_bits_list = plan.tree_start, plan.tree_bits
    return StepBatch(input_ids, positions, meta, li, plan.sample_rows, plan.offsets, plan.token_starts, sampling_table)


def upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``: one host tensor, one copy.

    On CUDA the host tensor is pinned first, so the copy is a true asynchronous DMA that
    does not make the host wait for the device's queue to drain.
    """
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class ModelRunner:
    """Owns the model and its KV cache; runs one step's forward."""

    def __init__(self, model, cfg: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, compile: bool = False):
        self.model = model
        self.cfg = cfg
        self.block_size = block_size
        self.device = device
        self.kv_caches = allocate_kv_cache(cfg, num_blocks, block_size, device, dtype)
        self.graphs: DecodeGraphs | None = None  # set by capture_cuda_graphs
        self.keep_hidden = False  # hand back the sampling rows' hidden states (ModelOutput.hidden)
        self.host_kv: HostKVCache | None = None  # the host KV tier's pool (kv_offload), set by enable_host_kv
        self.forward = model  # or the model's forward compiled into one graph (compiled.py)
        if compile:
            from .compiled import CompiledForward

            self.forward = CompiledForward(model)

    @property
    def kv_cache_bytes(self) -> int:
        return kv_cache_bytes(self.kv_caches)

    def enable_host_kv(self, num_blocks: int) -> None:
        """A host pool of ``num_blocks`` blocks for the host KV tier (``kv_offload``)."""
        self.host_kv = HostKVCache(self.kv_caches, num_blocks)

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture the decode forward once per batch-size bucket (CUDA, Triton backend).

        Not while a learner's function is plugged into a seam of the forward
        (``model.FORWARD_SEAMS``): a graph would replay its kernels after it is unplugged,
        and never call it again while plugged. Such an engine runs every step eagerly.
        """
        if not forward_seam_plugged():
            self.graphs = DecodeGraphs(self, max_num_seqs, max_model_len)

    @torch.inference_mode()
    def move_kv(self, moves: list[tuple[Request, int, int]]) -> None:
        """Copy each (request, from position, to position)'s K/V in every layer: a verified
        candidate tree's accepted path, written in node order, to the positions its tokens take.
        All sources are read before any destination is written."""
        src = [slots_for(r.block_ids, self.block_size, a, a + 1)[0] for r, a, _ in moves]
        dst = [slots_for(r.block_ids, self.block_size, b, b + 1)[0] for r, _, b in moves]
        src_t = torch.tensor(src, dtype=torch.long, device=self.device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=self.device)
        for k_cache, v_cache in self.kv_caches:
            for cache in (k_cache, v_cache):
                flat = cache.view(-1, *cache.shape[2:])
                flat.index_copy_(0, dst_t, flat.index_select(0, src_t))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelOutput:
        """One forward over the rows of ``out``; logits only where a row samples."""
        if out.kv_copies:  # the host tier's copies, before this forward writes or reads K/V
            self.host_kv.apply(out.kv_copies, self.kv_caches)
        b = build_batch(out.rows, self.block_size, self.device)
        # A learner's norm, RoPE or K/V store plugged in (model.FORWARD_SEAMS): the eager forward calls it.
        # Medusa heads need each step's hidden states (keep_hidden), which a graph does not hand back.
        if (self.graphs is not None and not self.keep_hidden and self.graphs.can_replay(out, b)
                and not forward_seam_plugged()):
            logits = self.graphs.replay(b)
            return ModelOutput(logits, b.rows, b.offsets, b.input_ids, b.token_starts, b.sampling_table)
        hidden = self.forward(b.input_ids, b.positions, b.meta, self.kv_caches)  # [T, hidden]
        rows = hidden[b.logits_index]
        logits = self.model.compute_logits(rows)  # [S, V]
        return ModelOutput(logits, b.rows, b.offsets, b.input_ids, b.token_starts, b.sampling_table,
                           hidden=rows if self.keep_hidden else None)


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every multiple of 8 up to max_num_seqs.

    A decode step of n rows replays the smallest bucket >= n, its extra rows padded; the
    buckets are few enough to capture in seconds, close enough that padding wastes little.
    """
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs + 8, 8))
    return sorted({min(b, max_num_seqs) for b in sizes})


class DecodeGraphs:
    """CUDA graphs of the pure-decode forward, one per batch-size bucket.

    A decode step of a small model is mostly launch overhead: dozens of small kernels per
    layer, each launched from Python. A CUDA graph records the launches of one forward
    once and replays them with a single call, as vLLM and nano-vllm do. A graph replays
    fixed addresses and shapes, so every input lives in a static buffer sized for the
    largest bucket: a step copies its (already uploaded) metadata into the front rows and
    pads the rest -- slot -1 (the store skips it), context length 1 -- and takes the first
    n rows of the static logits. Prefill and mixed steps, whose shapes vary token by
    token, run eagerly. Only the Triton backend can be captured: the torch backend plans
    every step on the host.
    """

    def __init__(self, runner: "ModelRunner", max_num_seqs: int, max_model_len: int):
        dev = runner.device
        self.runner = runner
        self.buckets = graph_buckets(max_num_seqs)
        B = self.buckets[-1]
        self.width = -(-max_model_len // runner.block_size)  # block-table columns of the longest request
        self.input_ids = torch.zeros(B, dtype=torch.long, device=dev)
        self.positions = torch.zeros(B, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((B,), -1, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(B, self.width, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(B + 1, dtype=torch.int32, device=dev)
        self.context_lens = torch.ones(B, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        pool = None
        for n in reversed(self.buckets):  # largest first: the smaller ones reuse its memory pool
            self._forward(n)  # warm-up launch outside the capture (allocator, lazy inits)
            torch.cuda.synchronize(dev)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.logits[n] = self._forward(n)
            pool = g.pool() if pool is None else pool
            self.graphs[n] = g
        torch.cuda.synchronize(dev)

    def _meta(self, n: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:n], block_tables=self.block_tables[:n],
            query_start_loc=self.query_start_loc[:n + 1], context_lens=self.context_lens[:n],
            block_size=self.runner.block_size, query_lens_list=[1] * n, context_lens_list=[1] * n)

    @torch.inference_mode()
    def _forward(self, n: int) -> torch.Tensor:
        model = self.runner.model
        hidden = model(self.input_ids[:n], self.positions[:n], self._meta(n), self.runner.kv_caches)
        return model.compute_logits(hidden)  # [n, V]: every decode row samples

    def can_replay(self, out: SchedulerOutput, b: StepBatch) -> bool:
        n = len(out.rows)
        return (0 < n <= self.buckets[-1] and len(b.rows) == n
                and all(r.num_new_tokens == 1 and not r.spec_token_ids for r in out.rows)
                and b.meta.block_tables.shape[1] <= self.width)

    def replay(self, b: StepBatch) -> torch.Tensor:
        """Logits [n, V] of a pure-decode step of n rows, from the smallest bucket that holds it."""
        n = len(b.rows)
        size = next(s for s in self.buckets if s >= n)
        w = b.meta.block_tables.shape[1]
        self.input_ids[:n].copy_(b.input_ids)
        self.positions[:n].copy_(b.positions)
        self.slot_mapping[:n].copy_(b.meta.slot_mapping)
        self.block_tables[:n, :w].copy_(b.meta.block_tables)  # columns past w are never read: ctx bounds them
        self.context_lens[:n].copy_(b.meta.context_lens)
        if size > n:  # padding rows: write nothing, attend one (stale but valid) slot
            self.slot_mapping[n:size].fill_(-1)
            self.context_lens[n:size].fill_(1)
        self.graphs[size].replay()
        # A view of the static output: the step samples from it before the next replay.
        return self.logits[size][:n]


@torch.inference_mode()
def prompt_logits(model, token_ids: list[int], chunk_size: int | None = None,
                  block_size: int = 16, forward=None) -> torch.Tensor:
    """Logits at every position of one prompt: [len(token_ids), vocab] float32.

    Runs the same flat varlen path as the engines, on a private paged cache, feeding the
    prompt whole or in chunks of ``chunk_size`` tokens (each chunk attends to the cached
    ones before it). Used to compare our forward with transformers'. ``forward``: another
    callable with the model's signature that runs it (``compiled.CompiledForward``).
    """
    p = next(model.parameters())
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    caches = allocate_kv_cache(model.cfg, num_blocks, block_size, p.device, p.dtype)
    from .sampling_params import SamplingParams

    req = Request("prompt_logits", list(token_ids), SamplingParams())
    req.block_ids = list(range(num_blocks))
    out = []
    step = chunk_size or n
    while req.num_computed_tokens < n:
        k = min(step, n - req.num_computed_tokens)
        b = build_batch([ScheduledRequest(req, k)], block_size, p.device)
        out.append(model.compute_logits((forward or model)(b.input_ids, b.positions, b.meta, caches)))
        req.num_computed_tokens += k
    return torch.cat(out)
