"""The CUDA-extension path of the causal conv1d: the one module that imports ``dflash_kernels._C``.

The extension is optional: setup.py builds it only where a CUDA torch and nvcc exist. Its launchers
here have the signatures and returns of the Triton launchers in ``conv1d.py``; they allocate the
outputs (through ``alloc``, so poisoned test runs cover them) and hand raw pointers and strides to
the kernels in ``csrc/causal_conv1d``.

Backend ``cuda`` forces these launchers; under ``auto`` on a CUDA input, :func:`choose_conv_impl`
times the CUDA and Triton paths once per shape bucket per GPU model and keeps the faster, persisted
with the runtime's tuning results.
"""

import threading
import time

import torch
import triton

from dflash_kernels.runtime import alloc, settings, tuning
from dflash_kernels.runtime.devices import device_index, on_device
from dflash_kernels.runtime.errors import BackendUnavailable, KernelCacheMiss

try:
    from dflash_kernels import _C
    _IMPORT_ERROR = None
except ImportError as e:  # a CPU-only or pure-Triton install
    _C = None
    _IMPORT_ERROR = e

__all__ = ["available", "choose_conv_impl", "cuda_causal_conv1d_fwd", "cuda_causal_conv1d_bwd",
           "cuda_causal_conv1d_update", "dispatch"]


def available() -> bool:
    """True when the CUDA extension ``dflash_kernels._C`` was built and imports."""
    return _C is not None


def _require(x: torch.Tensor):
    if _C is None:
        raise BackendUnavailable(
            f"conv1d: backend 'cuda' needs the CUDA extension dflash_kernels._C, which is not built "
            f"({_IMPORT_ERROR}); reinstall on a machine with a CUDA torch and nvcc: "
            f"pip install -e . --no-build-isolation (see README, 'CUDA extension')")
    if x.device.type != "cuda":
        raise BackendUnavailable(f"conv1d: backend 'cuda' needs CUDA tensors, got device {x.device}")


def _is_channel_last(x: torch.Tensor) -> bool:
    return x.stride(1) == 1 and x.stride(2) != 1


def _seq_int32(seq_idx):
    # The kernels read int32 ids with stride 1 along T (the Triton kernel also narrows to int32).
    if seq_idx is None:
        return None
    if seq_idx.dtype != torch.int32:
        seq_idx = seq_idx.to(torch.int32)
    return seq_idx if seq_idx.stride(1) == 1 else seq_idx.contiguous()


# ---------------------------------------------------------------------------------------- launchers
def cuda_causal_conv1d_fwd(x, weight, bias, seq_idx, initial_states, silu: bool, return_final_states: bool):
    """As ``conv1d.causal_conv1d_fwd``: returns ``(y, final_states)``, final_states empty unless asked."""
    _require(x)
    B, D, _ = x.shape
    W = weight.shape[1]
    y = alloc.empty_like(x)
    final = alloc.empty((B, D, W - 1) if return_final_states else (0,), dtype=x.dtype, device=x.device)
    _C.causal_conv1d_fwd(x, weight, bias, _seq_int32(seq_idx), initial_states, y,
                         final if return_final_states else None, bool(silu))
    return y, final


def cuda_causal_conv1d_bwd(dy, dfinal, x, weight, bias, seq_idx, initial_states, silu: bool):
    """As ``conv1d.causal_conv1d_bwd``: returns ``(dx, dweight, dbias or None, dinitial_states or None)``."""
    _require(x)
    B, D, _ = x.shape
    W = weight.shape[1]
    if dy.dtype != x.dtype:
        dy = dy.to(x.dtype)
    dx = alloc.empty_like(x)
    # One fp32 partial row per block, summed here: deterministic, no float atomics in the kernel.
    parts = _C.causal_conv1d_bwd_partials(x, weight)
    dw_part = alloc.empty((parts, D, W), dtype=torch.float32, device=x.device)
    db_part = alloc.empty((parts, D), dtype=torch.float32, device=x.device) if bias is not None else None
    dinit = (alloc.empty((B, D, W - 1), dtype=initial_states.dtype, device=x.device)
             if initial_states is not None else None)
    _C.causal_conv1d_bwd(dy, dfinal, x, weight, bias, _seq_int32(seq_idx), initial_states, dx,
                         dw_part, db_part, dinit, bool(silu))
    dweight = dw_part.sum(0).to(weight.dtype)
    dbias = db_part.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias, dinit


def cuda_causal_conv1d_update(x, conv_state, weight, bias, silu: bool):
    """As ``conv1d.causal_conv1d_update_fwd``: x ``[B, D, L]``; conv_state ``[B, D, S]`` updated in place."""
    _require(x)
    y = alloc.empty_like(x)
    _C.causal_conv1d_update(x, conv_state, weight, bias, y, bool(silu))
    return y


# ------------------------------------------------------------------------- choice by measurement
_choices = {}  # (device index, bucket) -> "cuda" | "triton"; read without a lock (dict get is atomic)
_choice_guard = threading.Lock()
_choice_locks = {}


def _key_lock(key):
    with _choice_guard:
        lock = _choice_locks.get(key)
        if lock is None:
            lock = _choice_locks[key] = threading.Lock()
        return lock


def _persist_name(bucket) -> str:
    # An edited kernel on either side is measured again: the CUDA sources' hash and the Triton
    # version are in the name (the latter through the store's file name).
    return f"conv1d_impl|{_C.source_hash() if _C is not None else 'none'}|{bucket!r}"


def _time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


def choose_conv_impl(bucket, device, run_triton, run_cuda, timer=_time_ms) -> str:
    """``"cuda"`` or ``"triton"``, whichever runs this shape bucket faster on this GPU model.

    Timed once per bucket per GPU model: the first caller warms both paths (Triton compiles and tunes
    its own configs under the tuning lock, so that happens before we take it), then times both under
    the runtime's per-device tuning lock so concurrent tuning cannot skew the comparison, and
    persists the winner with the tuning results; later processes read it from disk. Threads that
    miss the same bucket wait for the one measuring it. ``run_*`` are zero-argument callables that
    run one call of each path on scratch outputs.
    """
    dev = device_index(device)
    key = (dev, bucket)
    hit = _choices.get(key)
    if hit is not None:
        return hit
    with _key_lock(key):
        hit = _choices.get(key)
        if hit is not None:
            return hit
        store = tuning.store()
        name = _persist_name(bucket)
        saved = store.get(dev, name)
        if saved is not None:
            impl = saved["impl"]
        elif not settings.tuning_enabled():
            # No timing allowed: Triton. On the H200 (benchmarks/results, session 6) the channel-first
            # forwards are within 5% of each other (B=8, D=10240, T=16384: 1.358 Triton vs 1.353 ms
            # CUDA), the CUDA channel-last path is 3-5x slower, and fwd+bwd splits by shape (B=8:
            # Triton 3.81 vs CUDA 4.12 ms; B=4, T=4096: CUDA 0.54 vs 0.60-0.78): the timed choice
            # finds the faster per bucket; untimed, the one without a slow layout is the safe default.
            impl = "triton"
        else:
            if settings.is_strict():
                raise KernelCacheMiss(f"strict mode: the conv1d CUDA-vs-Triton choice for bucket {bucket!r} "
                                      f"is not measured yet; precompile this shape first or leave strict mode")
            with on_device(dev):
                run_triton()
                run_cuda()
                if dev >= 0:
                    torch.cuda.synchronize(dev)
                with tuning.tuning_lock(dev):
                    t0 = time.perf_counter()
                    ms = {"triton": timer(run_triton), "cuda": timer(run_cuda)}
                    seconds = time.perf_counter() - t0
            impl = "cuda" if ms["cuda"] <= ms["triton"] else "triton"
            store.put(dev, name, {"impl": impl, "ms": ms, "seconds": seconds})
            if settings.verbose():
                print(f"[dflash_kernels] conv1d {bucket!r}: {impl} (cuda {ms['cuda']:.4f} ms, "
                      f"triton {ms['triton']:.4f} ms)")
        _choices[key] = impl
        return impl


def reset_choices() -> None:
    """Forget the in-memory choices (the persisted ones stay on disk)."""
    with _choice_guard:
        _choices.clear()
        _choice_locks.clear()


def _bucket(n: int, cap: int) -> int:
    return triton.next_power_of_2(min(max(n, 1), cap))


def dispatch(kind: str, backend: str, run_triton, run_cuda, args: tuple):
    """Run launcher ``kind`` (``fwd``/``bwd``/``update``) with ``args`` on the chosen implementation.

    backend: the op's configured backend (``backends.get_backend``). ``cuda`` forces the extension
    (a clear :class:`BackendUnavailable` when it is absent); ``auto`` on a CUDA input measures per
    bucket when the extension is built; anything else runs Triton.
    """
    if backend == "cuda":
        return run_cuda(*args)
    x = args[2] if kind == "bwd" else args[0]
    if backend != "auto" or _C is None or x.device.type != "cuda" or settings.interpreting():
        return run_triton(*args)
    bucket = _bucket_of(kind, args)
    impl = _choices.get((device_index(x.device), bucket))
    if impl is None:
        # The decode step updates conv_state in place: time it on a scratch copy.
        trial_args = (args[0], args[1].clone()) + tuple(args[2:]) if kind == "update" else args
        impl = choose_conv_impl(bucket, x.device, lambda: run_triton(*trial_args),
                                lambda: run_cuda(*trial_args))
    return run_cuda(*args) if impl == "cuda" else run_triton(*args)


def _bucket_of(kind: str, args: tuple):
    if kind == "update":
        x, weight = args[0], args[2]
        B, D, L = x.shape
        return ("update", str(x.dtype), weight.shape[1], _bucket(L, 64), _bucket(B * D, 1 << 20))
    if kind == "fwd":
        x, weight, _, seq_idx, initial_states = args[:5]
    else:
        x, weight, _, seq_idx, initial_states = args[2], args[3], args[4], args[5], args[6]
    B, D, T = x.shape
    return (kind, str(x.dtype), weight.shape[1], _is_channel_last(x), seq_idx is not None,
            initial_states is not None, _bucket(T, 1 << 16), _bucket(B * D, 1 << 20))
