"""The kernel cache: every Triton kernel compiled once per key, tuned once per GPU model, shared by threads.

Why not ``kernel[grid](...)`` and ``triton.autotune``: Triton's ``Autotuner`` keeps per-call state on
the shared kernel object (``self.nargs``), so two threads tuning at once crash each other, and
``JITFunction.run`` re-binds and re-specializes every argument on every call. Here a launch is:

1. hot path, lock-free: build the key (shape bucket, constexprs, Triton's own specialization of each
   argument: dtype, 16-byte alignment, int width and divisibility; device), one ``dict.get``, and a
   direct call of the compiled kernel's launcher on the input's device and current stream;
2. miss: a per-key lock, checked twice, so each key compiles exactly once while other keys compile
   concurrently, and threads that miss the same key wait for that one compile. On the GPU the
   candidate configs are timed once (under a per-device lock) unless a persisted result exists.

Kernel signatures put every runtime parameter first and every ``tl.constexpr`` last, so a launch is
``args + constexpr values`` with no per-call binding.
"""

import inspect
import threading
import time
import zlib

import torch
import triton
from triton import knobs
from triton.runtime.errors import OutOfResources
from triton.runtime.jit import MockTensor

from dflash_kernels.runtime import choice, compile_pool, kernel_bundle, settings, tuning
from dflash_kernels.runtime.devices import current_stream, on_device

from triton.backends.compiler import BaseBackend

try:  # triton >= 3.5: the specializer is native code
    from triton.runtime.jit import native_specialize_impl as _specialize
except ImportError:  # triton 3.4: a Python closure around the backend's argument specialization
    from triton.runtime.jit import create_specialize_impl as _create_specialize_impl

    _specialize_34 = _create_specialize_impl(BaseBackend.get_arg_specialization)

    def _specialize(backend, arg, is_const, specialize_value, align):
        return _specialize_34(arg, is_const, specialize_value, align)

__all__ = ["Config", "TritonKernel", "cache_info", "reset_cache", "all_kernels"]


try:  # the raw getter: torch.cuda.current_device() adds a lazy-init check per call
    from torch._C import _cuda_getDevice as _get_device
except ImportError:  # pragma: no cover - CPU-only builds of torch
    _get_device = torch.cuda.current_device


def _no_fast_spec(*args):
    return None


def _gluon_descriptor_type():
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    except ImportError:  # pragma: no cover - a Triton without Gluon
        return None
    return TensorDescriptor


_GluonDescriptor = _gluon_descriptor_type()
_LAYOUT_FIELDS = ("swizzle_byte_width", "element_bitwidth", "rank", "transposed", "fp4_padded")


def describe_launch(args, constexprs):
    """A launch's signature as JSON: per runtime argument ``["T", dtype, 16-byte aligned]`` (a tensor), ``["D",
    dtype, block shape, shared layout fields, padding]`` (a Gluon TMA descriptor: what Triton specializes it on),
    ``["I", value]``, ``["F", value]``, ``["B", value]`` or ``["N"]``; the constexprs by name. None when an
    argument or constexpr is of another type (such a launch is not recorded)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(["T", str(a.dtype).replace("torch.", ""), a.data_ptr() % 16 == 0])
        elif _GluonDescriptor is not None and type(a) is _GluonDescriptor:
            if a.layout.cga_layout:
                return None
            out.append(["D", str(a.base.dtype).replace("torch.", ""), list(a.block_shape),
                        {f: getattr(a.layout, f) for f in _LAYOUT_FIELDS}, a.padding])
        elif a is None:
            out.append(["N"])
        elif type(a) is bool:
            out.append(["B", a])
        elif type(a) is int:
            out.append(["I", a])
        elif type(a) is float:
            out.append(["F", a])
        else:
            return None
    if not all(v is None or type(v) in (bool, int, float, str) for v in constexprs.values()):
        return None
    return {"args": out, "constexprs": dict(constexprs)}


class _UnalignedMock(MockTensor):
    @staticmethod
    def data_ptr():
        return 8


def _mock_arg(desc):
    """The stand-in of a recorded argument that Triton's ``warmup`` specializes exactly as the real one."""
    kind = desc[0]
    if kind == "T":
        dtype = getattr(torch, desc[1])
        return MockTensor(dtype) if desc[2] else _UnalignedMock(dtype)
    if kind == "D":  # a descriptor over a stand-in of its block's own shape: Triton reads dtype, box and layout
        from triton.experimental.gluon.language import NVMMASharedLayout

        _, dtype, block, layout, padding = desc
        strides = [1] * len(block)
        for i in range(len(block) - 2, -1, -1):
            strides[i] = strides[i + 1] * max(block[i + 1], 8)
        return _GluonDescriptor(MockTensor(getattr(torch, dtype)), list(block), strides, list(block),
                                NVMMASharedLayout(**layout), padding)
    return None if kind == "N" else desc[1]


def _no_launch(grid, args):
    """The launch of a precompile compile worker's entries: compiled, never run (see ``_compile_share``)."""


def _active(hook):
    """A launch hook, or None when none is installed: Triton 3.5+ keeps an always-present (and
    always truthy) ``HookChain`` that would cost a Python call per launch when empty."""
    if hook is None or not getattr(hook, "calls", True):
        return None
    return hook


class Config:
    """One tuning candidate: constexpr block sizes plus the ``num_warps`` / ``num_stages`` launch options, and
    ``maxnreg`` (registers per thread at launch) for kernels that set it, as the warp-specialized Gluon kernels
    do (their partitions then redistribute them with ``setmaxnreg``)."""

    def __init__(self, num_warps: int = 4, num_stages: int = 2, maxnreg: int | None = None, **meta):
        self.meta = meta
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.maxnreg = maxnreg

    def launch_options(self) -> dict:
        """The compile options of ``warmup``: ``maxnreg`` only where set (an unset one is not an option)."""
        opts = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.maxnreg is not None:
            opts["maxnreg"] = self.maxnreg
        return opts

    def as_dict(self) -> dict:
        return {**self.meta, **self.launch_options()}

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        d = dict(d)
        return cls(num_warps=d.pop("num_warps", 4), num_stages=d.pop("num_stages", 2), maxnreg=d.pop("maxnreg", None),
                   **d)

    def __repr__(self):
        return "Config(" + ", ".join(f"{k}={v}" for k, v in self.as_dict().items()) + ")"


class _Entry:
    """A compiled (or, under the interpreter, prepared) kernel for one key."""

    __slots__ = ("launch", "config", "meta", "hits", "compiles", "compile_s", "tune_s", "tuned_from")

    def __init__(self):
        self.hits = 0
        self.compiles = 0
        self.compile_s = 0.0
        self.tune_s = 0.0
        self.tuned_from = "none"


# Triton's interpreter patches triton.language module attributes for the duration of a launch and
# restores them after, so two interpreted launches at once break each other. Interpreted launches
# (the CPU test backend) are serialized; compiled launches never take this lock.
_interpreter_lock = threading.Lock()

_registry = []  # every TritonKernel, for cache_info / reset_cache
_registry_lock = threading.Lock()


def all_kernels():
    with _registry_lock:
        return list(_registry)


class TritonKernel:
    """A ``@triton.jit`` kernel behind the thread-safe per-key compile cache.

    Args:
        fn: the ``@triton.jit`` function. Runtime parameters first, ``tl.constexpr`` parameters last.
            Ints that vary per call (lengths, strides) belong in its ``do_not_specialize`` list, so a
            new length does not compile a new kernel.
        name: a stable name, used in cache keys, strict-mode errors and the tuning file.
        configs: tuning candidates; their ``meta`` become constexpr keyword arguments.
        interpret_config: the config used under ``TRITON_INTERPRET=1`` (default: the first).
        reset_to_zero: parameter names zeroed before each tuning trial (outputs accumulated with atomics).
        restore: parameter names restored after tuning (kernels that update a tensor in place).
    """

    def __init__(self, fn, *, name, configs, interpret_config=None, reset_to_zero=(), restore=()):
        assert configs, f"{name}: at least one config"
        self.fn = fn
        self.name = name
        self.configs = list(configs)
        self.interpret_config = interpret_config or self.configs[0]
        self.interpreted = not hasattr(fn, "warmup") or type(fn).__name__ == "InterpretedFunction"
        py_fn = fn.fn if hasattr(fn, "fn") else fn
        params = list(inspect.signature(py_fn).parameters.values())
        names = [p.name for p in params]
        is_constexpr = ["constexpr" in str(p.annotation) for p in params]
        n_runtime = is_constexpr.index(True) if True in is_constexpr else len(params)
        assert not any(is_constexpr[:n_runtime]) and all(is_constexpr[n_runtime:]), (
            f"{name}: runtime parameters must come first and tl.constexpr parameters last")
        self.runtime_names = names[:n_runtime]
        self.constexpr_names = names[n_runtime:]
        self.constexpr_defaults = {p.name: p.default for p in params[n_runtime:]
                                   if p.default is not inspect.Parameter.empty}
        dns = self._flag_set(fn, "do_not_specialize")
        dnsa = self._flag_set(fn, "do_not_specialize_on_alignment")
        self._spec = self._make_spec(self.runtime_names, dns, dnsa)
        self._dns, self._dnsa = dns, dnsa
        self._fast_spec = None  # generated from the first call's argument types; see _make_fast_spec
        self._reset_idx = [self.runtime_names.index(n) for n in reset_to_zero]
        self._restore_idx = [self.runtime_names.index(n) for n in restore]
        self._source_hash = self._hash_source(fn)
        self._cache = {}
        self._key_locks = tuning.KeyLocks()
        self._spec_lock = threading.Lock()
        with _registry_lock:
            _registry.append(self)

    @staticmethod
    def _flag_set(fn, attr):
        values = getattr(fn, attr, None)
        # The interpreter keeps the jit options in ``kwargs`` (triton 3.6) or on its rewriter (3.4).
        for holder in (fn, getattr(fn, "rewriter", None)):
            if values is None and hasattr(holder, "kwargs"):
                values = holder.kwargs.get(attr)
        return set(values or ())

    @staticmethod
    def _make_spec(names, dns, dnsa):
        """Generate ``spec(*args) -> tuple``: Triton's own specialization of each runtime argument.

        Generated as straight-line code (no per-call loop), the same way Triton builds its binder.
        """
        items = []
        for i, n in enumerate(names):
            specialize = n not in dns and i not in dns
            align = n not in dnsa and i not in dnsa
            items.append(f"_s(_B, a{i}, False, {specialize}, {align})")
        src = (f"def spec({', '.join(f'a{i}' for i in range(len(names)))}):\n"
               f"    return ({', '.join(items)}{',' if len(items) == 1 else ''})\n")
        namespace = {"_s": _specialize, "_B": BaseBackend}
        exec(src, namespace)
        return namespace["spec"]

    def _make_fast_spec(self, args):
        """Generate ``fast(*args) -> key or None`` for the argument types of ``args``.

        It returns the same information as Triton's specialization (dtype and 16-byte alignment of a
        tensor, i32/i64/u64 width and, unless ``do_not_specialize``, ``== 1`` and ``% 16 == 0`` of an
        int; dtype, box and shared layout of a Gluon TMA descriptor) in plain attribute reads and comparisons,
        about a third of the cost of calling ``native_specialize_impl`` per argument. It returns None when an argument's type differs
        from the pattern, and the caller falls back to the generic key. Returns None (no fast path)
        for argument types it does not know.
        """
        conds, items, namespace = [], [], {"_Tensor": torch.Tensor}
        for i, (name, a) in enumerate(zip(self.runtime_names, args)):
            if isinstance(a, torch.Tensor):
                # Any tensor subclass (an nn.Parameter): Triton treats them alike, and the first call must not
                # decide the key's form (a precompile on plain tensors, then the real call on parameters).
                conds.append(f"isinstance(a{i}, _Tensor)")
                items.append(f"a{i}.dtype")
                if name not in self._dnsa and i not in self._dnsa:
                    items.append(f"a{i}.data_ptr() & 15 == 0")
                continue
            namespace[f"_T{i}"] = type(a)
            conds.append(f"type(a{i}) is _T{i}")
            if _GluonDescriptor is not None and type(a) is _GluonDescriptor:
                # What Triton specializes a Gluon TMA descriptor on (``tensordesc<dtype[block], layout>``),
                # and its padding (which Triton reads at launch): shape, strides and base are launch values.
                items += [f"a{i}.base.dtype", f"tuple(a{i}.block_shape)", f"a{i}.layout", f"a{i}.padding"]
                continue
            if type(a) is int:
                if name not in self._dns and i not in self._dns:
                    items += [f"a{i} == 1", f"a{i} & 15 == 0"]
                items.append(f"(0 if -2147483648 <= a{i} <= 2147483647 else 1 if a{i} < 9223372036854775808 else 2)")
            elif a is not None and type(a) not in (float, bool):
                return None  # the types fully determine Triton's treatment of None, float and bool
        n = len(args)
        src = (f"def fast({', '.join(f'a{i}' for i in range(n))}):\n"
               f"    if not ({' and '.join(conds) or 'True'}):\n        return None\n"
               f"    return ('fast', {', '.join(items)}{',' if len(items) == 1 else ''})\n")
        exec(src, namespace)
        return namespace["fast"]

    @staticmethod
    def _hash_source(fn) -> str:
        try:
            return fn.cache_key[:16]  # covers the kernel's source and the jit functions it calls
        except Exception:
            import hashlib
            py_fn = fn.fn if hasattr(fn, "fn") else fn
            return hashlib.sha256(inspect.getsource(py_fn).encode()).hexdigest()[:16]

    def __call__(self, grid, *args, bucket=(), **constexprs):
        """Launch on the device of the first tensor argument. See the class docstring."""
        dev = self._device_of(args)
        fast = self._fast_spec
        if fast is None:
            fast = self._first_call_spec(args)
        spec = fast(*args)
        if spec is None:  # argument types differ from the first call's: Triton's own specialization
            spec = self._spec(*args)
        key = (bucket, tuple(constexprs.items()), spec, dev)
        entry = self._cache.get(key)
        if entry is None:
            entry = self._miss(key, grid, args, constexprs, dev)
        else:
            entry.hits += 1  # statistics only: a lost increment under a race is acceptable
        entry.launch(grid, args)

    def _first_call_spec(self, args):
        # Built once, under a lock, so every thread computes keys with the same function.
        with self._spec_lock:
            if self._fast_spec is None:
                fast = self._make_fast_spec(args) if len(args) == len(self.runtime_names) else None
                self._fast_spec = fast or _no_fast_spec
            return self._fast_spec

    @staticmethod
    def _device_of(args):
        for a in args:
            if isinstance(a, torch.Tensor):
                return a.get_device()  # -1 on the CPU, else the CUDA ordinal
        raise AssertionError("a kernel launch needs at least one tensor argument")

    def _miss(self, key, grid, args, constexprs, dev):
        with self._key_locks(key):
            entry = self._cache.get(key)
            if entry is not None:  # another thread compiled it while we waited
                entry.hits += 1
                return entry
            settings.check_strict(self.name, key)
            if dev >= 0 and not self.interpreted:  # the package's compiled kernels for this GPU, before compiling
                kernel_bundle.ensure_shipped(dev)
            shard = settings.compile_shard()
            if shard is not None and not self.interpreted:
                entry = self._compile_share(key, args, constexprs, dev, shard)
                self._cache[key] = entry
                return entry
            entry = _Entry()
            t0 = time.perf_counter()
            if self.interpreted:
                config = self.interpret_config
            else:
                config = self._choose_config(key, grid, args, constexprs, dev, entry)
            entry.config, entry.meta, entry.launch = self._launcher_that_fits(config, constexprs, args, dev)
            entry.compiles += 1
            entry.compile_s = time.perf_counter() - t0 - entry.tune_s
            if not self.interpreted:
                self._record_signature(key, args, constexprs, dev)
            if settings.verbose():
                print(f"[dflash_kernels] compiled {self.name} {key!r} -> {config} "
                      f"({entry.compile_s:.2f}s compile, {entry.tune_s:.2f}s tune, {entry.tuned_from})")
            self._cache[key] = entry  # publish last: a reader sees a complete entry or none
            return entry

    def _launcher_that_fits(self, config, constexprs, args, dev):
        """Build ``config``; when it needs more shared memory or registers than this GPU has (a config
        list written for every K, tuning off), the next config in list order that fits, with a message
        under DFLASH_KERNELS_VERBOSE. Any other compile error propagates."""
        order = [config] + [c for c in self.configs if c is not config and not self.interpreted]
        for i, cfg in enumerate(order):
            meta = {**constexprs, **cfg.meta}
            try:
                return cfg, meta, self._build_launcher(cfg, meta, args, dev)
            except OutOfResources as e:
                if i == len(order) - 1:
                    raise
                if settings.verbose():
                    print(f"[dflash_kernels] {self.name}: {cfg} does not fit ({e}); trying {order[i + 1]}")

    def _record_signature(self, key, args, constexprs, dev):
        """Save the key's launch signature in the tuning store (once per GPU model), so that
        ``precompile_recorded`` can compile it ahead of time in a fresh process or on another machine."""
        signature = describe_launch(args, constexprs)
        if signature is None:
            return
        store = tuning.store()
        name = tuning.SIGNATURE_PREFIX + self._persist_name(key)
        tags = settings.record_tags()
        saved = store.get(dev, name)
        if saved is None or not set(tags) <= set(saved.get("tags", ())):
            if tags or (saved is not None and saved.get("tags")):
                signature["tags"] = sorted(set(tags) | set(saved.get("tags", ()) if saved else ()))
            store.put(dev, name, signature)

    def _signature_configs(self, persist_name, dev):
        """The configs a key needs compiled: its stored tuning result's config, else every candidate when
        tuning is on, else the first."""
        if len(self.configs) > 1 and settings.tuning_enabled():
            saved, _ = tuning.store().lookup(dev, persist_name)
            return [Config.from_dict(saved["config"])] if saved is not None else list(self.configs)
        return [self.configs[0]]

    def compiled_for_signature(self, persist_name, signature, dev, configs=None):
        """The compiled kernels (Triton's ``CompiledKernel``, from its on-disk cache when there) of a recorded
        launch signature's configs (``configs``, else those :meth:`_signature_configs` names), compiling what is
        missing; configs that do not fit this GPU are left out."""
        args = [_mock_arg(a) for a in signature["args"]]
        out = []
        for config in configs if configs is not None else self._signature_configs(persist_name, dev):
            meta = {**signature["constexprs"], **config.meta}
            try:
                with on_device(dev):
                    out.append(self.fn.warmup(*args, *self._full_meta(meta), grid=(1,), **config.launch_options()))
            except OutOfResources:
                pass
        return out

    def compile_signature(self, persist_name, signature, dev, shard):
        """Compile, into Triton's on-disk cache, this worker's share (``shard``: (index, count)) of the configs
        a recorded launch signature will need: its stored tuning result's config, else every candidate when
        tuning is on, else the first. Returns the number compiled."""
        index, shards = shard
        mine = [c for c in self._signature_configs(persist_name, dev)
                if zlib.crc32(f"{persist_name}|{c!r}".encode()) % shards == index]
        n = 0
        for compiled in self.compiled_for_signature(persist_name, signature, dev, mine):
            try:
                with on_device(dev):
                    # Also builds the launcher (host code Triton compiles with the system's C compiler per
                    # signature, cached beside the kernel): a fraction of a second each, off the first step too.
                    compiled._init_handles()
                n += 1
            except OutOfResources:  # not a candidate on this GPU
                pass
        return n

    def _compile_share(self, key, args, constexprs, dev, shard):
        """A precompile compile worker's miss: compile this worker's share of the configs the key will need
        (its stored config when the tuning store has one, else every candidate when tuning is on, else the
        first) into Triton's on-disk cache, and launch nothing. The share is a stable hash of (kernel, key,
        config) modulo the number of workers, so the workers split every key's configs between them and the
        main process then finds each one compiled."""
        index, shards = shard
        entry = _Entry()
        entry.tuned_from = "compile-only"
        configs = self._signature_configs(self._persist_name(key), dev)
        t0 = time.perf_counter()
        for config in configs:
            if zlib.crc32(f"{self.name}|{key[:3]!r}|{config!r}".encode()) % shards != index:
                continue
            meta = {**constexprs, **config.meta}
            try:
                with on_device(dev):
                    self.fn.warmup(*args, *self._full_meta(meta), grid=(1,),
                                   **config.launch_options())._init_handles()  # the launcher too
                entry.compiles += 1
            except OutOfResources:  # not a candidate on this GPU: the main process skips it too
                pass
        entry.compile_s = time.perf_counter() - t0
        entry.config, entry.meta = configs[0], {**constexprs, **configs[0].meta}
        entry.launch = _no_launch
        return entry

    def _full_meta(self, meta):
        return tuple(meta[n] if n in meta else self.constexpr_defaults[n] for n in self.constexpr_names)

    def _build_launcher(self, config, meta, args, dev):
        if self.interpreted:
            fn = self.fn
            kwargs = {n: meta[n] for n in self.constexpr_names if n in meta}

            def launch(grid, args):
                g = grid(meta) if callable(grid) else grid
                with _interpreter_lock:
                    fn[g](*args, **kwargs)
            return launch

        tail = self._full_meta(meta)
        with on_device(dev):
            compiled = self.fn.warmup(*args, *tail, grid=(1,), **config.launch_options())
            compiled._init_handles()
        run, function, packed = compiled.run, compiled.function, compiled.packed_metadata

        def launch(grid, args):
            g = grid(meta) if callable(grid) else grid
            g0 = g[0]
            g1 = g[1] if len(g) > 1 else 1
            g2 = g[2] if len(g) > 2 else 1
            enter, leave = _active(knobs.runtime.launch_enter_hook), _active(knobs.runtime.launch_exit_hook)
            lm = compiled.launch_metadata(g, current_stream(dev), *args, *tail) if enter is not None else None
            if _get_device() != dev:
                with on_device(dev):
                    run(g0, g1, g2, current_stream(dev), function, packed, lm, enter, leave, *args, *tail)
            else:
                run(g0, g1, g2, current_stream(dev), function, packed, lm, enter, leave, *args, *tail)
        return launch

    def _persist_name(self, key):
        bucket, constexprs, spec, _ = key
        return f"{self.name}|{self._source_hash}|{bucket!r}|{constexprs!r}|{spec!r}"

    def _choose_config(self, key, grid, args, constexprs, dev, entry):
        if settings.compile_candidates_only() and len(self.configs) > 1:
            for config in self.configs[1:]:  # the first is built by the caller
                try:
                    self._build_launcher(config, {**constexprs, **config.meta}, args, dev)
                except Exception:  # noqa: BLE001 - a candidate that does not fit is no candidate
                    pass
        if len(self.configs) == 1 or not settings.tuning_enabled():
            entry.tuned_from = "single" if len(self.configs) == 1 else "disabled"
            return self.configs[0]
        store = tuning.store()
        name = self._persist_name(key)
        saved, source = store.lookup(dev, name)
        if saved is not None:
            entry.tuned_from = source  # "disk" (this cache) or "packaged" (shipped with the package)
            return Config.from_dict(saved["config"])
        t0 = time.perf_counter()
        if dev >= 0 and len(self.configs) > 1:  # the candidates compiled side by side first (runtime/compile_pool.py)
            signature = describe_launch(args, constexprs)
            if signature is not None:
                compile_pool.compile_candidates(self, signature, dev)
        with tuning.tuning_lock(dev):
            best, timings = self._time_configs(grid, args, constexprs, dev)
            entry.tune_s = time.perf_counter() - t0
        entry.tuned_from = "timed"
        store.put(dev, name, {"config": best.as_dict(), "ms": timings[repr(best)],
                              "candidates": timings})
        return best

    def _time_configs(self, grid, args, constexprs, dev):
        saved = [args[i].clone() for i in self._restore_idx]
        timings, best, best_ms = {}, None, float("inf")
        with on_device(dev), torch.cuda.stream(torch.cuda.current_stream(dev)):
            for config in self.configs:
                meta = {**constexprs, **config.meta}
                try:
                    launch = self._build_launcher(config, meta, args, dev)
                except Exception as e:  # out of shared memory / registers: not a candidate here
                    timings[repr(config)] = f"failed: {type(e).__name__}"
                    continue

                def trial():
                    for i in self._reset_idx:
                        args[i].zero_()
                    launch(grid, args)
                ms = triton.testing.do_bench(trial, warmup=5, rep=25, return_mode="median")
                timings[repr(config)] = ms
                if ms < best_ms:
                    best, best_ms = config, ms
            for i, value in zip(self._restore_idx, saved):
                args[i].copy_(value)
        if best is None:
            raise RuntimeError(f"{self.name}: no config compiled for this input: {timings}")
        return best, timings

    def cache_info(self) -> dict:
        return {(self.name,) + k: {"hits": e.hits, "compiles": e.compiles, "compile_s": e.compile_s,
                                   "tune_s": e.tune_s, "config": e.config.as_dict(),
                                   "tuned_from": e.tuned_from}
                for k, e in list(self._cache.items())}

    def reset(self):
        self._cache.clear()
        self._key_locks.clear()


def cache_info() -> dict:
    """Per compiled key: hits, compiles, compile and tune seconds, chosen config.

    Keys are ``(kernel name, bucket, constexprs, argument specialization, device index)``.

    Returns:
        ``{key: {"hits", "compiles", "compile_s", "tune_s", "config", "tuned_from"}}``; ``config`` is the chosen
        config as a dict, ``tuned_from`` where it came from: ``timed`` (tuned here), ``disk`` (this cache
        folder), ``packaged`` (shipped with the package), ``single`` (one candidate), ``disabled``
        (``DFLASH_KERNELS_TUNE=0``), ``compile-only`` (a precompile compile worker) or ``none`` (the
        interpreter).
    """
    info = {}
    for k in all_kernels():
        info.update(k.cache_info())
    return info


def reset_cache() -> None:
    """Forget every compiled kernel and every timed choice among implementations (``choice.py``);
    persisted tuning results stay on disk. Takes no arguments and returns None; the next call of each
    kernel compiles it again (and reads its tuning from disk)."""
    for k in all_kernels():
        k.reset()
    choice.reset_choices()
