"""Capture, for the AOT audit (tools/aot_audit.py): which Triton kernel variants the
engine's launches reach on a GPU we do not have.

``kernel[grid](*args)`` goes through JITFunction.run: it asks the active *driver* for
the target GPU, binds the arguments into a specialisation (pointer dtypes; for integers
whether they equal 1 or are divisible by 16; constexpr values; num_warps/num_stages)
and compiles on a cache miss. ``capture(gpu)`` installs a fake driver that reports
``gpu``, makes the wrappers plan for it (tile sizes, split counts: the
``minillm.kernels._common._aot_target`` hook), and swaps JITFunction._do_compile for a
recorder. Calling the real wrappers on CPU tensors shaped like the engine's then
records exactly the variants the JIT would compile on that GPU -- and launches nothing.
Every patch is undone on exit.

This patches private parts of the installed triton package (JITFunction._do_compile,
the driver's ``_active``), which is why it lives here, next to the audit, and not in
minillm: the engine's own ``minillm.kernels.warmup`` only launches kernels on a GPU.
Written against triton 3.x; a triton upgrade may need it adjusted (the aot tests say so).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
from dataclasses import dataclass, field
from typing import Iterable

import torch

from minillm.kernels import _common
from minillm.kernels._common import H100, HAS_TRITON, GpuSpec
from minillm.kernels.warmup import Launch, dtype_name, engine_launches

KERNELS_PACKAGE = "minillm.kernels"


def check_compile_mode() -> None:
    if not HAS_TRITON:
        raise RuntimeError("the AOT audit needs the 'triton' package")
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError(
            "the AOT audit needs compiled-mode kernels: unset TRITON_INTERPRET before importing triton "
            "(under the interpreter @triton.jit makes interpreter objects, which nothing can compile)")


@dataclass
class Variant:
    """One specialisation of one kernel = one binary the JIT would build."""

    kernel: str
    fn: object = field(repr=False)  # the JITFunction
    signature: dict = field(repr=False)  # arg name -> type ("*bf16", "i32", "constexpr", ...)
    constexprs: dict = field(repr=False)  # arg path -> value
    attrs: dict = field(repr=False)  # arg path -> [["tt.divisibility", 16]], ...
    options: dict = field(repr=False)  # num_warps, num_stages, ... (the target's parsed options)
    target: GpuSpec
    dtype: str  # dtype of the launch that first reached it
    launch: Launch  # the first launch that reached it

    @property
    def key(self) -> tuple:
        return (self.fn.__module__, self.kernel, self.target.capability, repr(sorted(self.signature.items())),
                repr(sorted(self.constexprs.items())), repr(sorted(self.attrs.items())),
                repr(sorted(self.options.items())))

    def describe(self) -> str:
        """The compile-time facts: constexprs, integers specialised to 1, divisibility, warps/stages."""
        names = list(self.signature)
        consts = [f"{names[p[0]]}={v}" for p, v in sorted(self.constexprs.items())]
        div16 = [names[p[0]] for p, a in sorted(self.attrs.items()) if "divisibility" in repr(a)
                 and not self.signature[names[p[0]]].startswith("*")]
        text = " ".join(consts)
        if div16:
            text += f" %16:{','.join(div16)}"
        return f"{text} warps={self.options.get('num_warps')} stages={self.options.get('num_stages')}"


class FakeDriver:
    """Just enough of a Triton driver for JITFunction.run to bind and specialise arguments."""

    def __init__(self, gpu: GpuSpec):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", gpu.capability, 32)
        self.device = f"aot:{gpu.arch}"  # a key no real device uses in JITFunction.device_caches

    def get_current_device(self):
        return self.device

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def is_active(self):
        return True


class _StandIn:
    """Takes a compiled kernel's place in JITFunction's cache: a later launch with the
    same specialisation finds it (skipping the costly argument packing, as the real JIT
    does) and "runs" it, which only tells the recorder which variant was reached."""

    function = None
    packed_metadata = None

    def __init__(self, recorder: "Recorder", key: tuple):
        self.recorder, self.key = recorder, key

    def launch_metadata(self, *args):
        return None

    def run(self, *args):
        self.recorder._hit(self.key)


class Recorder:
    """Collects the variants the launches reach, one entry per distinct binary."""

    def __init__(self, gpu: GpuSpec):
        self.gpu = gpu
        self.variants: dict[tuple, Variant] = {}
        self.errors: list[tuple[str, str]] = []  # (launch label, wrapper error): a failure too
        self._launch: Launch | None = None
        self._hits: list[tuple] | None = None

    def _record(self, fn, signature, constexprs, attrs, options) -> "_StandIn":
        launch = self._launch
        v = Variant(fn.__name__, fn, dict(signature), dict(constexprs), dict(attrs), dict(options.__dict__),
                    self.gpu, dtype_name(launch.dtype) if launch else "?", launch)
        self.variants.setdefault(v.key, v)
        return _StandIn(self, v.key)

    def _hit(self, key) -> None:
        if self._hits is not None:
            self._hits.append(key)

    def run(self, launches: Iterable[Launch]) -> list[Variant]:
        """Call each launch on CPU tensors; returns the distinct variants they reach."""
        self._hits = []
        try:
            for launch in launches:
                self._launch = launch
                try:
                    launch.run(torch.device("cpu"))
                except Exception as e:  # a wrapper that rejects the engine's own inputs is a failure
                    self.errors.append((launch.label, f"{type(e).__name__}: {e}"))
            keys = dict.fromkeys(self._hits)
        finally:
            self._hits, self._launch = None, None
        return [self.variants[k] for k in keys]


@contextlib.contextmanager
def capture(gpu: GpuSpec = H100):
    """Record, instead of compiling and launching, every kernel specialisation the
    wrappers reach while planning for ``gpu``. Yields a Recorder; undoes every patch.

    Process-wide while it lasts (a class attribute, the active driver): launch no
    kernels from another thread meanwhile.
    """
    check_compile_mode()
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    recorder = Recorder(gpu)

    def recording_do_compile(self, key, signature, device, constexprs, options, attrs, *rest, **kwargs):
        stand_in = recorder._record(self, signature, constexprs, attrs, options)
        self.device_caches[device][0][key] = stand_in  # kernel_cache: the next identical launch is a hit
        return stand_in  # JITFunction.run "launches" it: nothing runs

    fake = FakeDriver(gpu)
    saved_active = getattr(driver, "_active", None)
    saved_do_compile = JITFunction.__dict__["_do_compile"]
    saved_target = _common._aot_target
    JITFunction._do_compile = recording_do_compile
    driver.set_active(fake)
    _common._aot_target = gpu
    try:
        yield recorder
    finally:
        _common._aot_target = saved_target
        JITFunction._do_compile = saved_do_compile
        # Straight back to what was there (None on a CPU-only machine: never build the real driver).
        driver._active = saved_active
        # Drop the binders and stand-ins made for the fake device, from every kernel.
        for fn in [v.fn for v in recorder.variants.values()] + list(find_jit_kernels().values()):
            fn.device_caches.pop(fake.device, None)


def find_jit_kernels() -> dict[str, object]:
    """Every @triton.jit function defined in a module of minillm.kernels ("module.name" ->
    JITFunction). Subpackages are not searched: kernels/cpu/ holds the C++ backend."""
    check_compile_mode()
    from triton.runtime.jit import JITFunction

    pkg = importlib.import_module(KERNELS_PACKAGE)
    found = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.ispkg:
            continue
        mod = importlib.import_module(f"{KERNELS_PACKAGE}.{info.name}")
        for name, obj in vars(mod).items():
            if isinstance(obj, JITFunction) and obj.__module__ == mod.__name__:
                found[f"{info.name}.{name}"] = obj
    return found


def restored() -> bool:
    """True if no capture() left anything behind: the recorder gone, the driver as it was."""
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    leftovers = [dev for fn in find_jit_kernels().values() for dev in fn.device_caches if str(dev).startswith("aot:")]
    return (JITFunction.__dict__["_do_compile"].__name__ == "_do_compile"
            and not isinstance(getattr(driver, "_active", None), FakeDriver)
            and _common._aot_target is None and not leftovers)


def reachable_variants(model, dtype: torch.dtype, block_size: int, *, max_num_seqs: int = 256,
                       max_model_len: int | None = None, gpu: GpuSpec = H100) -> dict[str, list[Variant]]:
    """kernel name -> the distinct binaries a minillm engine can compile for this model,
    dtype and KV block size on ``gpu`` (all batches up to max_num_seqs, all contexts up to
    max_model_len, default the model's): what minillm.kernels.warmup compiles on that GPU.
    Needs compiled-mode Triton (TRITON_INTERPRET unset)."""
    with capture(gpu) as rec:
        variants = rec.run(engine_launches(model, dtype, block_size, gpu, max_num_seqs=max_num_seqs,
                                           max_model_len=max_model_len))
    if rec.errors:
        raise RuntimeError(f"wrapper errors while enumerating variants: {rec.errors[:3]}")
    out: dict[str, list[Variant]] = {}
    for v in variants:
        out.setdefault(v.kernel, []).append(v)
    return out
