"""Medusa heads: the target model drafts its own next tokens from its last hidden state.

The base LM head reads the final hidden state h_t (after the last RMSNorm) and predicts
token t + 1. A Medusa-1 head k (k = 0 .. K-1) reads the same h_t and predicts token
t + 2 + k, further ahead:

    r_k = h + SiLU(W_k h + b_k)        # one residual block, W_k [hidden, hidden]
    logits_k = r_k @ E^T               # E: the model's tied embedding, shared and frozen

W_k and b_k start at zero, so an untrained head *is* the base LM head (it predicts t + 1
where it should predict t + 2 + k): training moves it from there. Only W_k and b_k are
parameters; E stays the model's (a non-persistent buffer here, not saved with the heads).

- ``MedusaHeads``: the K heads; ``logits``, ``loss`` (cross-entropy in chunks of rows,
  vocab-sized logits are large), ``accuracy`` (top-1 / top-5 of each head), ``save`` /
  ``load`` (safetensors, float16 on disk, float32 in memory, with metadata);
- ``head_positions``: which positions of a sequence feed head k, and their targets;
- ``read_metadata``: the metadata and tensor shapes of a heads file, from its header alone.

The heads are trained by self-distillation (``minillm.bench.train_medusa``): the model's
own greedy continuations are the targets.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

FORMAT = "minillm-medusa-1"
SHIPPED = Path(__file__).with_name("medusa_smollm2.safetensors")  # where train_medusa writes SmolLM2's heads


def head_positions(num_tokens: int, k: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """For head k over a sequence of ``num_tokens`` tokens: the positions t whose hidden
    state it reads (t >= ``start``) and the indices t + 2 + k of the tokens it predicts
    (only those inside the sequence). Both int64, same length (possibly 0)."""
    if k < 0:
        raise ValueError(f"head index k must be >= 0, got {k}")
    t = torch.arange(max(start, 0), max(num_tokens - 2 - k, 0), dtype=torch.int64)
    return t, t + 2 + k


class MedusaHeads(nn.Module):
    """K Medusa-1 heads over a model's final hidden states, sharing its tied embedding.

    ``embedding``: the model's embedding / LM head matrix [vocab, hidden] (held, not
    trained, not saved). ``weight`` [K, hidden, hidden] and ``bias`` [K, hidden] are the
    heads' only parameters, zero at the start.
    """

    def __init__(self, embedding: torch.Tensor, num_heads: int = 4, hidden_size: int | None = None):
        super().__init__()
        if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads < 1:
            raise ValueError(f"num_heads (K) must be an integer >= 1, got {num_heads!r}")
        if not isinstance(embedding, torch.Tensor) or embedding.dim() != 2:
            shape = tuple(embedding.shape) if isinstance(embedding, torch.Tensor) else type(embedding).__name__
            raise ValueError(f"embedding must be a [vocab, hidden] matrix, got {shape}")
        hidden = embedding.shape[1] if hidden_size is None else hidden_size
        if embedding.shape[1] != hidden:
            raise ValueError(f"embedding shape {tuple(embedding.shape)} does not match hidden size {hidden}: "
                             f"expected [vocab, {hidden}]")
        self.num_heads = num_heads
        self.hidden_size = int(hidden)
        self.vocab_size = int(embedding.shape[0])
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden, hidden))
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden))
        self.register_buffer("embedding", embedding.detach(), persistent=False)
        self.metadata: dict[str, Any] = {}  # what ``load`` read from the file
        self.quantized: nn.ModuleList | None = None  # W_k in fewer bits (``quantize``), or None
        self.quantized_head: nn.Module | None = None  # the vocabulary projection in 8-bit groups, or None

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, hidden_size={self.hidden_size}, vocab_size={self.vocab_size}"

    def _check_hidden(self, hidden: torch.Tensor) -> None:
        if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1 or hidden.shape[-1] != self.hidden_size:
            shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise ValueError(f"hidden states must end in the hidden size {self.hidden_size}, got {shape}")

    def _heads(self, heads: Sequence[int] | None) -> list[int]:
        heads = list(range(self.num_heads)) if heads is None else list(heads)
        for k in heads:
            if not 0 <= k < self.num_heads:
                raise ValueError(f"head index {k} out of range 0..{self.num_heads - 1}")
        return heads

    def residual(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """r_k = h + SiLU(W_k h + b_k): [..., hidden] -> [..., hidden]."""
        self._check_hidden(hidden)
        (k,) = self._heads([k])
        h = hidden.to(self.weight.dtype)
        if self.quantized is not None:
            return h + F.silu(self.quantized[k](h) + self.bias[k])
        if h.is_inference() and torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            h = h.clone()  # hidden states of an inference_mode forward: a plain copy autograd may save
        return h + F.silu(F.linear(h, self.weight[k], self.bias[k]))

    def head_logits(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Head k's float32 logits [..., vocab] over hidden states [..., hidden]."""
        r = self.residual(hidden, k)
        if self.quantized_head is not None:
            return self.quantized_head(r).float()
        return F.linear(r, self.embedding.to(r.dtype)).float()

    def forward(self, hidden: torch.Tensor, heads: Sequence[int] | None = None) -> torch.Tensor:
        """[N, hidden] -> float32 logits [len(heads), N, vocab] (all K heads by default);
        head k's row t predicts the token at t + 2 + k."""
        heads = self._heads(heads)
        if self.quantized_head is not None and hidden.dim() == 2:
            # every head's rows in one call: the kernel reads the vocabulary projection once, not once a head
            r = torch.cat([self.residual(hidden, k) for k in heads])
            return self.quantized_head(r).float().view(len(heads), hidden.shape[0], self.vocab_size)
        return torch.stack([self.head_logits(hidden, k) for k in heads])

    @torch.no_grad()
    def quantize(self, scheme: str, head: nn.Module | None = None) -> "MedusaHeads":
        """Draft with the heads' matrices in ``scheme`` ("int8" or "q4", ``minillm/quantization.py``),
        on the CPU kernels: each W_k in the scheme's groups, and the vocabulary projection in
        symmetric 8-bit groups as the engine quantizes its LM head (``head``: a quantized LM head
        to share, the target's when it is quantized itself; else one made from ``embedding``,
        which holds the GGUF's 8-bit embedding exactly where it is float32). A step's heads then
        read the projection once between them, in 8 bits. Training, ``loss`` and ``save`` keep
        the float parameters; returns self."""
        from minillm.quantization import LAYER_FORMAT, QuantizedLinear, check_scheme

        check_scheme(scheme)
        if scheme is None:
            raise ValueError("quantize takes 'int8' or 'q4'")
        fmt = LAYER_FORMAT[scheme]
        self.quantized = nn.ModuleList(QuantizedLinear(self.weight[k].float(), fmt) for k in range(self.num_heads))
        self.quantized_head = (head if head is not None
                               else QuantizedLinear(self.embedding.float(), "int8_group", symmetric=True))
        return self

    logits = forward

    # ------------------------------------------------------------ training and measuring

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor, k: int, chunk: int = 1024) -> torch.Tensor:
        """Mean cross-entropy of head k on rows ``hidden`` [N, hidden] with ``targets`` [N]
        (the token ids t + 2 + k ahead), ``chunk`` rows of [chunk, vocab] logits at a time
        (summed, then divided by N: the same value as one big call)."""
        self._check_hidden(hidden)
        if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
            raise ValueError(f"need hidden [N, {self.hidden_size}] and targets [N], got {tuple(hidden.shape)} "
                             f"and {tuple(targets.shape)}")
        n = hidden.shape[0]
        if n == 0:
            raise ValueError("no rows to compute a loss on")
        total = hidden.new_zeros((), dtype=torch.float32)
        for i in range(0, n, chunk):
            logits = self.head_logits(hidden[i:i + chunk], k)
            total = total + F.cross_entropy(logits, targets[i:i + chunk], reduction="sum")
        return total / n

    @torch.no_grad()
    def accuracy(self, hidden: torch.Tensor | Sequence[torch.Tensor], tokens: torch.Tensor | Sequence[torch.Tensor],
                 topk: Sequence[int] = (1, 5), start: int | Sequence[int] = 0,
                 chunk: int = 1024) -> list[dict[str, float | int]]:
        """Each head's accuracy at predicting the token k + 2 ahead.

        ``hidden`` [T, hidden] and ``tokens`` [T] of one sequence (hidden[t] is the state
        after reading tokens[t]), or lists of them for several sequences (pooled). Head k
        reads positions t >= ``start`` (one per sequence, or one for all) and is scored on
        tokens[t + 2 + k]. Returns one dict per head: ``{"top1": ..., "top5": ...,
        "count": n}`` (the keys follow ``topk``; an accuracy is 0.0 where count is 0).
        """
        if isinstance(hidden, torch.Tensor):
            hidden, tokens = [hidden], [tokens]
        hidden, tokens = list(hidden), list(tokens)
        if len(hidden) != len(tokens):
            raise ValueError(f"got {len(hidden)} hidden-state tensors for {len(tokens)} token sequences")
        starts = [start] * len(hidden) if isinstance(start, int) else list(start)
        if len(starts) != len(hidden):
            raise ValueError(f"got {len(starts)} starts for {len(hidden)} sequences")
        topk = sorted({int(t) for t in topk})
        if not topk or topk[0] < 1 or topk[-1] > self.vocab_size:
            raise ValueError(f"topk must be integers in 1..{self.vocab_size}, got {topk}")
        hits = torch.zeros(self.num_heads, len(topk), dtype=torch.int64)
        counts = [0] * self.num_heads
        for h, tok, s in zip(hidden, tokens, starts):
            self._check_hidden(h)
            tok = torch.as_tensor(tok, dtype=torch.int64)
            if h.dim() != 2 or tok.shape != h.shape[:1]:
                raise ValueError(f"need hidden [T, {self.hidden_size}] and tokens [T], got {tuple(h.shape)} "
                                 f"and {tuple(tok.shape)}")
            for k in range(self.num_heads):
                pos, tgt = head_positions(tok.shape[0], k, s)
                if pos.numel() == 0:
                    continue
                for i in range(0, pos.numel(), chunk):
                    logits = self.head_logits(h[pos[i:i + chunk]], k)
                    best = logits.topk(topk[-1], dim=-1).indices  # [n, max k]
                    target = tok[tgt[i:i + chunk]][:, None]
                    for j, kk in enumerate(topk):
                        hits[k, j] += int((best[:, :kk] == target).any(dim=-1).sum())
                counts[k] += pos.numel()
        return [{**{f"top{kk}": (hits[k, j].item() / counts[k] if counts[k] else 0.0) for j, kk in enumerate(topk)},
                 "count": counts[k]} for k in range(self.num_heads)]

    # ------------------------------------------------------------ the file

    def save(self, path: str | Path, **metadata: Any) -> Path:
        """Write the heads as safetensors, float16 on disk. The file's metadata holds K, the
        hidden and vocab sizes, and every keyword given here (JSON-encoded: base model, the
        command and seed that trained them, the data sizes, the accuracy)."""
        from safetensors.torch import save_file

        path = Path(path)
        meta = {"format": FORMAT, "num_heads": self.num_heads, "hidden_size": self.hidden_size,
                "vocab_size": self.vocab_size, **self.metadata, **metadata}
        tensors = {"weight": self.weight.detach().to("cpu", torch.float16).contiguous(),
                   "bias": self.bias.detach().to("cpu", torch.float16).contiguous()}
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata={key: json.dumps(value) for key, value in meta.items()})
        return path

    @classmethod
    def load(cls, path: str | Path, embedding: torch.Tensor) -> "MedusaHeads":
        """The heads of ``path`` (float32), sharing ``embedding`` [vocab, hidden]; the file's
        metadata in ``.metadata``. ValueError if they do not fit the embedding."""
        from safetensors.torch import load_file

        meta = read_metadata(path)
        tensors = load_file(str(path))
        if "weight" not in tensors or "bias" not in tensors:
            raise ValueError(f"{path}: not a Medusa heads file (tensors {sorted(tensors)})")
        weight, bias = tensors["weight"], tensors["bias"]
        K, hidden = int(meta.get("num_heads", weight.shape[0])), int(meta.get("hidden_size", weight.shape[-1]))
        if weight.shape != (K, hidden, hidden) or bias.shape != (K, hidden):
            raise ValueError(f"{path}: weight {tuple(weight.shape)} and bias {tuple(bias.shape)} do not match "
                             f"K={K}, hidden={hidden}")
        if isinstance(embedding, torch.Tensor) and embedding.dim() == 2 and embedding.shape[1] != hidden:
            raise ValueError(f"{path}: heads of hidden size {hidden} do not fit an embedding of shape "
                             f"{tuple(embedding.shape)}")
        if "vocab_size" in meta and isinstance(embedding, torch.Tensor) and embedding.dim() == 2 \
                and embedding.shape[0] != int(meta["vocab_size"]):
            raise ValueError(f"{path}: heads trained for vocab {meta['vocab_size']} do not fit an embedding of "
                             f"shape {tuple(embedding.shape)}")
        heads = cls(embedding, num_heads=K, hidden_size=hidden)
        with torch.no_grad():
            heads.weight.copy_(weight.float())
            heads.bias.copy_(bias.float())
        heads.metadata = {key: value for key, value in meta.items()
                          if key not in ("format", "num_heads", "hidden_size", "vocab_size", "shapes", "dtypes")}
        return heads


def read_metadata(path: str | Path) -> dict[str, Any]:
    """A heads file's metadata (JSON values decoded) and ``"shapes"`` of its tensors, read
    from the safetensors header alone (8 bytes of length, then JSON): no tensor is loaded."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > 100_000_000:
            raise ValueError(f"{path}: not a safetensors file (header of {n} bytes)")
        header = json.loads(f.read(n))
    raw = header.pop("__metadata__", {}) or {}
    meta: dict[str, Any] = {}
    for key, value in raw.items():
        try:
            meta[key] = json.loads(value)
        except (TypeError, ValueError):
            meta[key] = value
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not a Medusa heads file (format {meta.get('format')!r}, expected {FORMAT!r})")
    meta["shapes"] = {name: list(info["shape"]) for name, info in header.items()}
    meta["dtypes"] = {name: info["dtype"] for name, info in header.items()}
    return meta


__all__ = ["FORMAT", "SHIPPED", "MedusaHeads", "head_positions", "read_metadata"]
