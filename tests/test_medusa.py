"""Medusa heads (spec_decode/medusa.py): an untrained head is the LM head, head k predicts
token t + 2 + k, the file round-trips in float16, bad inputs are refused, and the training
split keeps a question's variants together. Tiny model with dummy weights."""
from __future__ import annotations

import pytest
import torch

from minillm import loader
from minillm.config import ModelConfig
from minillm.model import build_model
from minillm.spec_decode.medusa import MedusaHeads, head_positions, read_metadata

TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=256)


@pytest.fixture(scope="module")
def tiny():
    weights = loader.dummy_weights(TINY, seed=0)
    model = build_model(TINY, weights, torch.device("cpu"), torch.float32)
    return weights, model


def test_untrained_heads_are_the_lm_head(tiny):
    weights, model = tiny
    heads = MedusaHeads(model.embed.weight, num_heads=4)
    assert not heads.embedding.requires_grad and [n for n, _ in heads.named_parameters()] == ["weight", "bias"]
    assert "embedding" not in heads.state_dict()  # shared with the model, not the heads' own
    hidden = torch.randn(7, TINY.hidden_size, generator=torch.Generator().manual_seed(1))
    base = model.compute_logits(hidden)
    logits = heads(hidden)
    assert logits.shape == (4, 7, TINY.vocab_size) and logits.dtype == torch.float32
    for k in range(4):
        assert torch.equal(logits[k], base), k
    # and over the final hidden states of a real forward (transformers' Llama with the same weights)
    hf = loader.hf_model_from_weights(weights, TINY, torch.float32)
    ids = torch.tensor([[5, 17, 3, 99, 42, 8]])
    with torch.inference_mode():
        out = hf(input_ids=ids, output_hidden_states=True)
        h = hf.model(input_ids=ids).last_hidden_state[0]
    assert torch.equal(heads(h)[2], out.logits[0].float())
    # a trained head is not the LM head any more
    with torch.no_grad():
        heads.weight[1].normal_(0, 0.1)
    assert torch.equal(heads(hidden)[0], base) and not torch.allclose(heads(hidden)[1], base)


def test_head_positions():
    t, tgt = head_positions(10, 0)
    assert t.tolist() == list(range(8)) and tgt.tolist() == list(range(2, 10))
    t, tgt = head_positions(10, 3, start=2)
    assert t.tolist() == [2, 3, 4] and tgt.tolist() == [7, 8, 9]
    assert head_positions(4, 3)[0].numel() == 0
    with pytest.raises(ValueError, match="k must be >= 0"):
        head_positions(10, -1)


def _sequence_task(num_heads: int = 3, length: int = 40, vocab: int = 128, hidden: int = 64):
    """Distinct tokens, so the token at t says where in the sequence we are; h_t = E[token_t]."""
    g = torch.Generator().manual_seed(0)
    embedding = torch.randn(vocab, hidden, generator=g)
    tokens = torch.randperm(vocab, generator=g)[:length]
    h = embedding[tokens] / embedding[tokens].norm(dim=-1, keepdim=True)
    return MedusaHeads(embedding, num_heads=num_heads), tokens, h


def test_training_drives_each_head_to_the_token_k_plus_2_ahead():
    torch.manual_seed(0)
    heads, tokens, h = _sequence_task()
    T = len(tokens)
    before = heads.accuracy(h, tokens)
    assert all(a["top1"] < 0.2 for a in before)
    opt = torch.optim.Adam(heads.parameters(), lr=3e-2)
    for _ in range(150):
        opt.zero_grad()
        loss = 0
        for k in range(heads.num_heads):
            t, tgt = head_positions(T, k)
            loss = loss + heads.loss(h[t], tokens[tgt], k, chunk=7)  # chunks of rows: same loss
        loss.backward()
        opt.step()
    acc = heads.accuracy(h, tokens, topk=(1, 5))
    assert [a["count"] for a in acc] == [T - 2 - k for k in range(3)]
    assert all(a["top1"] == 1.0 and a["top5"] == 1.0 for a in acc), acc
    # independently of head_positions: head k's argmax at t is token t + 2 + k, not t + 1 + k nor t + 3 + k
    with torch.no_grad():
        pred = heads(h).argmax(-1)  # [K, T]
    for k in range(3):
        n = T - 2 - k
        assert torch.equal(pred[k, :n], tokens[2 + k:2 + k + n])
        assert (pred[k, :n - 1] == tokens[1 + k:1 + k + n - 1]).float().mean() < 0.2  # one short
        assert (pred[k, :n - 1] == tokens[3 + k:3 + k + n - 1]).float().mean() < 0.2  # one too far


def test_loss_in_chunks_equals_one_call():
    heads, tokens, h = _sequence_task()
    with torch.no_grad():
        heads.weight.normal_(0, 0.05)
    t, tgt = head_positions(len(tokens), 1)
    full = torch.nn.functional.cross_entropy(heads.head_logits(h[t], 1), tokens[tgt])
    assert torch.allclose(heads.loss(h[t], tokens[tgt], 1, chunk=5), full, atol=1e-6)


def test_accuracy_start_and_several_sequences():
    heads, tokens, h = _sequence_task()
    # untrained heads predict t + 1: top-1 is 0 on every head; start skips positions
    acc = heads.accuracy([h, h], [tokens, tokens], start=[10, 0])
    assert [a["count"] for a in acc] == [2 * (len(tokens) - 2 - k) - 10 for k in range(3)]
    assert all(a["top1"] == 0.0 for a in acc)


def test_save_load_round_trip(tmp_path):
    heads, tokens, h = _sequence_task(num_heads=2)
    with torch.no_grad():
        heads.weight.normal_(0, 0.05)
        heads.bias.normal_(0, 0.05)
    path = heads.save(tmp_path / "heads.safetensors", base_model="tiny", command="pytest", seed=7,
                      data={"prompts": 3, "tokens": 12})
    meta = read_metadata(path)
    assert meta["dtypes"] == {"weight": "F16", "bias": "F16"}  # float16 on disk
    assert meta["shapes"] == {"weight": [2, 64, 64], "bias": [2, 64]}
    assert (meta["num_heads"], meta["hidden_size"], meta["vocab_size"]) == (2, 64, 128)
    back = MedusaHeads.load(path, heads.embedding)
    assert back.weight.dtype == torch.float32 and back.num_heads == 2
    assert torch.equal(back.weight, heads.weight.detach().half().float())
    assert torch.equal(back.bias, heads.bias.detach().half().float())
    assert back.metadata == {"base_model": "tiny", "command": "pytest", "seed": 7,
                             "data": {"prompts": 3, "tokens": 12}}
    assert torch.allclose(back(h), heads(h), atol=1e-2)
    # saving the loaded heads keeps the metadata
    again = read_metadata(back.save(tmp_path / "again.safetensors"))
    assert again["command"] == "pytest" and again["data"] == {"prompts": 3, "tokens": 12}
    with pytest.raises(ValueError, match="hidden size 64"):
        MedusaHeads.load(path, torch.zeros(128, 32))
    with pytest.raises(ValueError, match="vocab 128"):
        MedusaHeads.load(path, torch.zeros(100, 64))


def test_not_a_heads_file(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match="not a Medusa heads file"):
        read_metadata(tmp_path / "x.safetensors")


def test_value_errors():
    E = torch.zeros(128, 64)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="K"):
            MedusaHeads(E, num_heads=bad)
    with pytest.raises(ValueError, match=r"\[vocab, hidden\]"):
        MedusaHeads(torch.zeros(64))
    with pytest.raises(ValueError, match="does not match hidden size 32"):
        MedusaHeads(E, hidden_size=32)
    heads = MedusaHeads(E, num_heads=2)
    with pytest.raises(ValueError, match="hidden size 64"):
        heads(torch.zeros(3, 32))
    with pytest.raises(ValueError, match="hidden size 64"):
        heads.accuracy(torch.zeros(5, 32), torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="tokens"):
        heads.accuracy(torch.zeros(5, 64), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="out of range"):
        heads(torch.zeros(3, 64), heads=[2])
    with pytest.raises(ValueError, match="targets"):
        heads.loss(torch.zeros(3, 64), torch.zeros(2, dtype=torch.int64), 0)


def test_heldout_split_keeps_questions_whole():
    from minillm.bench.train_medusa import prompt_texts, split_groups

    texts = prompt_texts()
    groups = [g for _, g in texts][:96]
    held = split_groups(groups, seed=0)
    n_held = sum(g in held for g in groups)
    assert 0.10 * len(groups) <= n_held <= 0.2 * len(groups)
    assert split_groups(groups, seed=0) == held and len({t for t, _ in texts}) == len(texts)


# ---------------------------------------------------------------- the engine's medusa drafter (a chain)

def _weights():
    """The tiny model's dummy weights with every matrix x10: at std 0.02 its greedy output repeats one
    token, which any draft of that token would match; at 0.2 it wanders (16-20 distinct tokens in 24)."""
    return {k: (v * 10 if v.dim() == 2 else v) for k, v in loader.dummy_weights(TINY, seed=0).items()}


def _engine(**kwargs):
    from minillm.config import EngineConfig
    from minillm.engine import build_engine
    opts = dict(engine="paged", device="cpu", dtype="float32", max_model_len=256, block_size=8, max_num_seqs=4,
                seed=0) | kwargs
    return build_engine(EngineConfig(**opts), weights=_weights(), model_config=TINY, tokenizer=None)


def _prompts():
    return [[(7 * i + 3 * j) % 120 + 4 for j in range(5 + 9 * i)] for i in range(4)]


def _run(engine, prompts, max_tokens=24):
    from minillm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in engine.run([engine.make_request(p, params) for p in prompts])]


def _greedy_paths(prompts, max_tokens=24):
    """Each prompt's greedy continuation by the plain engine, and transformers' final hidden states over it."""
    weights = _weights()
    outs = _run(_engine(), prompts, max_tokens)
    assert all(len(set(o)) > max_tokens // 2 for o in outs), "greedy output that repeats itself shows nothing"
    hf = loader.hf_model_from_weights(weights, TINY, torch.float32)
    seqs = [p + o for p, o in zip(prompts, outs)]
    with torch.inference_mode():
        hidden = [hf.model(input_ids=torch.tensor([s])).last_hidden_state[0].clone() for s in seqs]
    return weights, outs, seqs, hidden


def _fit_heads(weights, seqs, hidden, starts, num_heads=3, steps=300):
    """Heads overfit to these very sequences: they draft what the target will say (high acceptance)."""
    torch.manual_seed(0)
    heads = MedusaHeads(weights["embed.weight"], num_heads=num_heads)
    opt = torch.optim.Adam(heads.parameters(), lr=3e-2)
    rows = []
    for k in range(num_heads):
        xs, ys = [], []
        for h, s, st in zip(hidden, seqs, starts):
            t, tgt = head_positions(len(s), k, st)
            xs.append(h[t])
            ys.append(torch.tensor(s)[tgt])
        rows.append((torch.cat(xs), torch.cat(ys)))
    for _ in range(steps):
        opt.zero_grad()
        sum(heads.loss(x, y, k) for k, (x, y) in enumerate(rows)).backward()
        opt.step()
    return heads


@pytest.fixture(scope="module")
def fitted():
    prompts = _prompts()
    weights, outs, seqs, hidden = _greedy_paths(prompts)
    heads = _fit_heads(weights, seqs, hidden, [len(p) - 1 for p in prompts])
    return prompts, outs, heads


def test_medusa_chain_gives_the_plain_engines_greedy_tokens_and_drafts_well_from_fitted_heads(fitted):
    prompts, want, heads = fitted
    alone = [_run(_engine(speculative={"method": "medusa", "heads": heads, "num_speculative_tokens": 3,
                                        "disable_by_batch_size": None}), [p])[0] for p in prompts]
    assert alone == want
    engine = _engine(speculative={"method": "medusa", "heads": heads, "num_speculative_tokens": 3,
                                  "disable_by_batch_size": None})
    assert _run(engine, prompts) == want
    st = engine.spec_stats
    # Heads fitted to these continuations draft them: a shift of the hidden row by one would draft
    # the wrong position and be rejected nearly always.
    assert st.num_drafts > 0 and st.acceptance_rate > 0.8, st.as_dict()
    assert st.tokens_per_target_forward > 2.5


@pytest.mark.parametrize("scheme", ["int8", "q4"])
def test_quantized_heads_draft_alone_and_keep_the_plain_engines_greedy_tokens(fitted, scheme):
    """speculative={'method': 'medusa', 'quantization': ...}: the heads' W_k in the scheme's groups
    and their vocabulary projection in 8-bit groups, the target in float32: the output is the
    target's, the drafts still good; all heads' rows go through the projection in one call."""
    from minillm.quantization import QuantizedLinear

    prompts, want, heads = fitted
    engine = _engine(speculative={"method": "medusa", "heads": heads, "num_speculative_tokens": 3,
                                  "quantization": scheme, "disable_by_batch_size": None})
    drafting = engine.speculator.drafter.heads
    assert all(isinstance(q, QuantizedLinear) for q in drafting.quantized)
    assert drafting.quantized[0].fmt == {"int8": "int8_group", "q4": "q4_group"}[scheme]
    assert isinstance(drafting.quantized_head, QuantizedLinear) and engine.model.quantized_head is None
    assert _run(engine, prompts) == want
    st = engine.spec_stats
    assert st.num_drafts > 0 and st.acceptance_rate > 0.5, st.as_dict()
    h = torch.randn(3, heads.hidden_size, generator=torch.Generator().manual_seed(1))
    together = drafting(h)
    for k in range(heads.num_heads):  # one call for every head equals each head alone, bit for bit
        assert torch.equal(together[k], drafting.head_logits(h, k))
    float_logits = heads(h)
    assert 0 < (together - float_logits).abs().max() < 0.1 * float_logits.abs().max()


def test_quantized_heads_share_a_quantized_targets_head(fitted):
    prompts, want, heads = fitted
    engine = _engine(quantization="int8", speculative={"method": "medusa", "heads": heads, "num_speculative_tokens": 3,
                                                       "quantization": "int8", "disable_by_batch_size": None})
    assert engine.speculator.drafter.heads.quantized_head is engine.model.quantized_head
    plain = _engine(quantization="int8")
    assert _run(engine, prompts) == _run(plain, prompts)


@pytest.mark.parametrize("kwargs", [{"enable_chunked_prefill": True, "max_num_batched_tokens": 8},
                                    {"num_blocks": 10, "max_model_len": 64}], ids=["chunked-prefill", "preemption"])
def test_medusa_chain_is_exact_with_chunked_prefill_and_preemption(fitted, kwargs):
    prompts, want, heads = fitted
    engine = _engine(speculative={"method": "medusa", "heads": heads, "num_speculative_tokens": 3,
                                  "disable_by_batch_size": None}, **kwargs)
    assert _run(engine, prompts) == want
    assert engine.spec_stats.num_accepted > 0
    if "num_blocks" in kwargs:
        assert engine.scheduler.num_preemptions > 0, "no preemption happened"


def test_medusa_chain_with_untrained_heads_is_exact_too():
    prompts = _prompts()
    want = _run(_engine(), prompts)
    heads = MedusaHeads(_weights()["embed.weight"], num_heads=4)
    with torch.no_grad():
        heads.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
    engine = _engine(speculative={"method": "medusa", "heads": heads, "num_speculative_tokens": 4,
                                  "disable_by_batch_size": None})
    assert _run(engine, prompts) == want and engine.spec_stats.num_drafts > 0


def test_medusa_options_are_clear_errors(tmp_path):
    from minillm.config import EngineConfig
    heads = MedusaHeads(loader.dummy_weights(TINY, seed=0)["embed.weight"], num_heads=2)
    with pytest.raises(ValueError, match="at most 2"):
        _engine(speculative={"method": "medusa", "heads": heads, "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="no Medusa heads file"):
        _engine(speculative={"method": "medusa", "heads": str(tmp_path / "none.safetensors")})
    with pytest.raises(ValueError, match="heads is an option of the 'medusa' method"):
        EngineConfig(engine="paged", speculative={"method": "ngram", "heads": "x"})
    with pytest.raises(ValueError, match="process of their own"):
        EngineConfig(engine="paged", speculative={"method": "medusa", "draft_process": True})
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        EngineConfig(engine="paged", speculative={"method": "medusa"}, tensor_parallel_size=2)
    other = MedusaHeads(torch.zeros(64, TINY.hidden_size), num_heads=2)
    with pytest.raises(ValueError, match="embedding"):
        _engine(speculative={"method": "medusa", "heads": other, "num_speculative_tokens": 2})
    path = heads.save(tmp_path / "h.safetensors")  # from a file: the same checks
    engine = _engine(speculative={"method": "medusa", "heads": str(path), "num_speculative_tokens": 2})
    assert engine.speculator.drafter.heads.num_heads == 2


def test_serve_flags_pick_medusa_and_its_heads_file():
    from minillm.config import EngineConfig
    from minillm.serving.cli import _serve_parser, engine_kwargs_from_args

    args = _serve_parser().parse_args(["--speculative-method", "medusa", "--medusa-heads", "h.safetensors",
                                       "--num-speculative-tokens", "3"])
    kw = engine_kwargs_from_args(args)
    assert kw["speculative"] == {"method": "medusa", "heads": "h.safetensors", "num_speculative_tokens": 3}
    assert EngineConfig.from_kwargs(**kw).speculative.heads == "h.safetensors"
    with pytest.raises(ValueError, match="need --speculative-method"):
        engine_kwargs_from_args(_serve_parser().parse_args(["--medusa-heads", "h.safetensors"]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_medusa_chain_on_cuda_gives_the_plain_engines_greedy_tokens(fitted, dtype):
    prompts, _, heads = fitted
    opts = dict(device="cuda", dtype=dtype, attention_backend="triton")
    want = _run(_engine(**opts), prompts)
    engine = _engine(speculative={"method": "medusa", "heads": heads, "num_speculative_tokens": 3,
                                  "disable_by_batch_size": None}, cuda_graphs=True, **opts)
    assert engine.speculator.drafter.heads.weight.is_cuda
    assert _run(engine, prompts) == want
    assert engine.spec_stats.num_accepted > 0


# ---------------------------------------------------------------- the candidate tree in the engine

TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 0, 1)]


class SecondBest(torch.nn.Module):
    """Heads whose right token ranks second on heads 0 and 2: a chain of top-1 drafts misses,
    and a tree's path goes through rank-1 nodes, whose K/V sit away from their depth."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, hidden, heads=None):
        logits = self.inner(hidden, heads)
        top2 = logits.topk(2, dim=-1).indices
        out = logits.clone()
        for k in range(0, logits.shape[0], 2):
            out[k].scatter_(-1, top2[k, :, :1], logits[k].gather(-1, top2[k, :, 1:]))
            out[k].scatter_(-1, top2[k, :, 1:], logits[k].gather(-1, top2[k, :, :1]))
        return out


def _tree_engine(heads, second_best=True, **kwargs):
    spec = {"method": "medusa", "heads": heads, "tree": TREE, "disable_by_batch_size": None}
    engine = _engine(speculative=spec | kwargs.pop("speculative", {}), **kwargs)
    if second_best:
        engine.speculator.drafter.heads = SecondBest(engine.speculator.drafter.heads)
    moves = []
    move_kv = engine.runner.move_kv
    engine.runner.move_kv = lambda m: (moves.extend(m), move_kv(m))
    return engine, moves


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_medusa_tree_gives_the_plain_engines_greedy_tokens(fitted, backend):
    """Alone and batched, through rank-1 nodes: the tree mask lets each node read only its path,
    and the accepted path's K/V move to their depth (a node's K/V left where it was written, or a
    chain's causal mask, or positions by node index instead of depth, all change these tokens)."""
    prompts, want, heads = fitted
    if backend != "triton":  # (the interpreter is slow: batched only)
        alone = [_run(_tree_engine(heads, attention_backend=backend)[0], [p])[0] for p in prompts]
        assert alone == want
    engine, moves = _tree_engine(heads, attention_backend=backend)
    assert _run(engine, prompts) == want
    st = engine.spec_stats
    assert st.acceptance_rate > 0.8 and st.tokens_per_target_forward > 2.5, st.as_dict()
    assert sum(a - b == 1 for _, a, b in moves) > 10  # rank-1 nodes accepted: node n moved to depth n - 1
    chain = _engine(speculative={"method": "medusa", "heads": heads, "num_speculative_tokens": 3,
                                 "disable_by_batch_size": None}, attention_backend=backend)
    chain.speculator.drafter.heads = SecondBest(chain.speculator.drafter.heads)
    assert _run(chain, prompts) == want and chain.spec_stats.tokens_per_target_forward < 1.5


@pytest.mark.parametrize("kwargs", [{"enable_chunked_prefill": True, "max_num_batched_tokens": 16},
                                    {"num_blocks": 12, "max_model_len": 64}], ids=["chunked-prefill", "preemption"])
def test_medusa_tree_is_exact_with_chunked_prefill_and_preemption(fitted, kwargs):
    prompts, want, heads = fitted
    engine, moves = _tree_engine(heads, **kwargs)
    assert _run(engine, prompts) == want
    assert engine.spec_stats.num_accepted > 0 and moves
    if "num_blocks" in kwargs:
        assert engine.scheduler.num_preemptions > 0, "no preemption happened"
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks


def test_medusa_tree_seeded_sampling_is_plain_sampling_and_typical_acceptance_is_not(fitted):
    from minillm import SamplingParams
    prompts, _, heads = fitted
    params = SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=5)

    def run(engine):
        return [o.token_ids for o in engine.run([engine.make_request(p, params) for p in prompts])]

    want = run(_engine())
    exact, _ = _tree_engine(heads, second_best=False)
    assert run(exact) == want and exact.spec_stats.num_accepted > 0
    typical, _ = _tree_engine(heads, second_best=False, speculative={"acceptance": "typical"})
    assert run(typical) != want
    assert typical.spec_stats.tokens_per_target_forward > exact.spec_stats.tokens_per_target_forward


def test_medusa_tree_options_are_clear_errors():
    from minillm.config import EngineConfig
    heads = MedusaHeads(loader.dummy_weights(TINY, seed=0)["embed.weight"], num_heads=2)
    with pytest.raises(ValueError, match="3 deep but the Medusa heads are 2"):
        _engine(speculative={"method": "medusa", "heads": heads, "tree": TREE})
    with pytest.raises(ValueError, match="options of the 'medusa' method"):
        EngineConfig(engine="paged", speculative={"method": "ngram", "tree": TREE})
    with pytest.raises(ValueError, match="options of the 'medusa' method"):
        EngineConfig(engine="paged", speculative={"method": "ngram", "acceptance": "typical"})
    with pytest.raises(ValueError, match="add \\(1,\\)"):
        EngineConfig(engine="paged", speculative={"method": "medusa", "tree": [(0,), (1, 0)]})
    with pytest.raises(ValueError, match="list of choices"):
        EngineConfig(engine="paged", speculative={"method": "medusa", "tree": "big"})
    with pytest.raises(ValueError, match=r"in \[1, 12\] \(the tree's nodes\)"):
        EngineConfig(engine="paged", speculative={"method": "medusa", "tree": TREE, "num_speculative_tokens": 13})
    with pytest.raises(ValueError, match="'exact' or 'typical'"):
        EngineConfig(engine="paged", speculative={"method": "medusa", "acceptance": "greedy"})
    with pytest.raises(ValueError, match="typical_epsilon must be"):
        EngineConfig(engine="paged", speculative={"method": "medusa", "typical_epsilon": 0})
    spec = EngineConfig(engine="paged", speculative={"method": "medusa", "tree": TREE}).speculative
    assert spec.num_speculative_tokens == len(TREE) and spec.tree.depth == 3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_medusa_tree_on_cuda_gives_the_plain_engines_greedy_tokens(fitted, dtype):
    prompts, _, heads = fitted
    opts = dict(device="cuda", dtype=dtype, attention_backend="triton")
    want = _run(_engine(**opts), prompts)
    engine, moves = _tree_engine(heads, cuda_graphs=True, **opts)
    assert _run(engine, prompts) == want
    assert engine.spec_stats.num_accepted > 0 and moves


def test_compare_drafters_runs_each_engine_and_checks_its_tokens(fitted):
    from minillm.bench.medusa_measure import compare_drafters

    prompts, want, heads = fitted
    configs = {"plain": None,
               "n-gram": {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None},
               "tree": {"method": "medusa", "heads": heads, "tree": TREE, "disable_by_batch_size": None}}
    for batch in (1, 2):
        res = compare_drafters(prompts, configs, max_tokens=24, rounds=2, batch=batch,
                               build=lambda spec, n: _engine(speculative=spec, max_num_seqs=n))
        assert list(res) == list(configs) and all(r["same_tokens"] for r in res.values()), res
        assert res["plain"]["tokens_per_target_forward"] == 1.0 and res["plain"]["speedup"] == 1.0
        assert res["tree"]["tokens_per_target_forward"] > 2.5 and len(res["tree"]["round_tokens_per_s"]) == 2
