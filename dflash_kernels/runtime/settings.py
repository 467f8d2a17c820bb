"""Process-wide settings of the runtime: cache directory, strict mode, environment variables.

Environment variables (read at import, overridable from Python):
- ``DFLASH_KERNELS_CACHE_DIR``: where tuning results persist (default: ``$XDG_CACHE_HOME/dflash_kernels``
  or ``~/.cache/dflash_kernels``).
- ``DFLASH_KERNELS_STRICT=1``: a kernel-cache miss raises :class:`KernelCacheMiss` instead of compiling.
- ``DFLASH_KERNELS_BACKEND="op=name,op=name"``: per-op backend choice (see ``backends``).
- ``DFLASH_KERNELS_TUNE=0``: skip timing candidates on the GPU; take each kernel's first config.
  ``DFLASH_KERNELS_TUNE=compile``: compile every candidate (filling Triton's on-disk cache) but time
  none and take the first: a warm-up process run beside other GPU work, so that a later tuning run
  only times (nothing is persisted to the tuning store from it).
- ``DFLASH_KERNELS_VERBOSE=1``: print each compile and tuning result.
- ``DFLASH_KERNELS_PACKAGED_TUNING=0``: ignore the tuning results shipped with the package
  (``dflash_kernels/runtime/tuned/``; :mod:`dflash_kernels.runtime.tuning`) and time every key here.
- ``DFLASH_KERNELS_GDN_SAVE_STATES=1``, ``DFLASH_KERNELS_GDN_FWD_SPLIT=1|0``: the GDN forward's variants
  (:func:`gdn_save_states`, :func:`gdn_fwd_split`).
- ``DFLASH_KERNELS_GDN_BWD_LOCAL=twopass|onepass|group``: the GDN backward's local kernel (:func:`gdn_bwd_local`).
- ``DFLASH_KERNELS_GDN_FWD_PREPARE=split|fused``: the GDN forward's per-chunk preparation, its solve and w/u
  kernels (``split``, the default) or one kernel doing both (``fused``, opt-in) (:func:`gdn_fwd_prepare`).
- ``DFLASH_KERNELS_GDN_FWD=triton|gluon``: the GDN forward after its solve, the w/u kernel and the Triton scan
  (``triton``, the default) or the warp-specialized Gluon kernel on sm_90 (``gluon``, opt-in) (:func:`gdn_fwd`).
"""

import contextlib
import os
import threading

from dflash_kernels.runtime.errors import KernelCacheMiss

__all__ = ["cache_dir", "strict", "is_strict", "tuning_enabled", "verbose", "interpreting"]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> str:
    """The folder holding persisted tuning results; created on the first write. When it cannot be created or
    written, tuning results stay in the process's memory (one ``TuningCacheWarning``; ``tuning.py``)."""
    path = os.environ.get("DFLASH_KERNELS_CACHE_DIR")
    if not path:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = os.path.join(base, "dflash_kernels")
    return path


def gdn_save_states() -> bool:
    """DFLASH_KERNELS_GDN_SAVE_STATES=1: the GDN forward keeps its per-chunk states for the backward
    instead of the backward recomputing them (more memory, less time; fixed-length batches only)."""
    return _env_flag("DFLASH_KERNELS_GDN_SAVE_STATES")


def gdn_fwd_split():
    """``DFLASH_KERNELS_GDN_FWD_SPLIT``: how the GDN forward computes its output. ``1``: the state scan
    (storing each chunk's start state and U), then the output kernel parallel over chunks; ``0``: the scan
    with the output fused in; unset or ``auto``: the library picks by the number of sequences and heads
    (``gated_delta_rule._split_forward``). Returns True, False, or None for auto."""
    value = os.environ.get("DFLASH_KERNELS_GDN_FWD_SPLIT", "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"DFLASH_KERNELS_GDN_FWD_SPLIT: expected 1, 0 or auto, got {value!r}")


def _env_choice(name: str, choices: tuple) -> str:
    """The environment variable ``name``, lower-cased, one of ``choices`` (unset or empty: the first); another
    value raises ValueError naming the variable and the value."""
    value = os.environ.get(name, "").strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")
    return value


GDN_BWD_LOCAL_MODES = ("twopass", "onepass", "group")


def gdn_bwd_local() -> str:
    """``DFLASH_KERNELS_GDN_BWD_LOCAL``: which local kernel the GDN backward runs. ``twopass`` (default): one
    pass over V, then one per column block of K; ``onepass``: a single pass over V with K whole; ``group``: the
    one-pass kernel per key head, summing its value heads' dq and dk and applying the l2norm backward itself.
    Another value raises ValueError naming it."""
    return _env_choice("DFLASH_KERNELS_GDN_BWD_LOCAL", GDN_BWD_LOCAL_MODES)


GDN_FWD_PREPARE_MODES = ("split", "fused")


def gdn_fwd_prepare() -> str:
    """``DFLASH_KERNELS_GDN_FWD_PREPARE``: how the GDN forward prepares each chunk (t_bad, G, A = (I + L)^-1, then
    w and u). ``split`` (default): the solve kernel, then the w/u kernel, which reads A, G, k, v and beta back from
    memory; ``fused``: one kernel doing both per chunk and value head (``kernels_fwd_fused.py``; the same results).
    The backward's recompute of w and u keeps the w/u kernel either way. Another value raises ValueError naming it."""
    return _env_choice("DFLASH_KERNELS_GDN_FWD_PREPARE", GDN_FWD_PREPARE_MODES)


GDN_FWD_MODES = ("triton", "gluon")


def gdn_fwd() -> str:
    """``DFLASH_KERNELS_GDN_FWD``: which kernels run the GDN forward after its solve. ``triton`` (default): the
    w/u kernel and the Triton scan (fused or split); ``gluon`` (opt-in, sm_90): the warp-specialized Gluon kernel
    of ``kernels_gluon_sm90_fwd.py`` (U from A, no w / u), for the inputs it takes (a ValueError names the others).
    Another value raises ValueError naming it."""
    return _env_choice("DFLASH_KERNELS_GDN_FWD", GDN_FWD_MODES)


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return _env_flag("TRITON_INTERPRET")


def tuning_enabled() -> bool:
    return os.environ.get("DFLASH_KERNELS_TUNE", "1").strip() not in ("0", "false", "no", "off", "compile")


def compile_candidates_only() -> bool:
    return os.environ.get("DFLASH_KERNELS_TUNE", "1").strip() == "compile"


# Set only in the compile workers of ``precompile`` (runtime/precompile.py): (shard, shards). There a kernel-cache
# miss compiles its share of the key's configs into Triton's on-disk cache and launches nothing.
_compile_shard = None


def compile_shard():
    """``(shard, shards)`` in a precompile compile worker, else None."""
    return _compile_shard


def set_compile_shard(shard) -> None:
    global _compile_shard
    _compile_shard = None if shard is None else (int(shard[0]), int(shard[1]))


def process_count(env: str, cap: int) -> int:
    """Helper processes to start: ``env`` when set (a whole number >= 0), else the usable cores up to ``cap``,
    divided among torchrun's processes on this machine (``LOCAL_WORLD_SIZE``)."""
    text = os.environ.get(env, "").strip()
    if text:
        try:
            n = int(text)
        except ValueError:
            raise ValueError(f"{env}: expected a whole number, got {text!r}") from None
        if n < 0:
            raise ValueError(f"{env}: expected >= 0, got {n}")
        return n
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = os.environ.get("LOCAL_WORLD_SIZE", "1")
    local = int(share) if share.isdigit() and int(share) > 0 else 1
    return max(1, min(cores // local, cap))


def verbose() -> bool:
    return _env_flag("DFLASH_KERNELS_VERBOSE")


def record_tags() -> tuple:
    """Names that every launch signature recorded in this process is tagged with
    (``DFLASH_KERNELS_RECORD_TAG``, comma-separated): a run records under its preset's name, so that
    ``python -m dflash_kernels.precompile --preset NAME`` can later compile exactly that run's kernels."""
    text = os.environ.get("DFLASH_KERNELS_RECORD_TAG", "")
    return tuple(sorted({t.strip() for t in text.split(",") if t.strip()}))


def shipped_kernels() -> bool:
    """Whether the compiled kernels shipped with the package are copied into Triton's cache folder before the
    first compile on a GPU they were built for (default on; ``DFLASH_KERNELS_SHIPPED_KERNELS=0`` turns it off)."""
    return os.environ.get("DFLASH_KERNELS_SHIPPED_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def packaged_tuning() -> bool:
    """Whether the tuning results shipped with the package are read where the cache has none (default on;
    ``DFLASH_KERNELS_PACKAGED_TUNING=0`` turns them off)."""
    return os.environ.get("DFLASH_KERNELS_PACKAGED_TUNING", "1").strip().lower() not in ("0", "false", "no", "off")


# Strict mode is process-wide on purpose: a trainer enters it once in the main thread after
# precompiling, and every worker thread must then obey it.
_strict_depth = 0
_strict_lock = threading.Lock()


def is_strict() -> bool:
    return _strict_depth > 0 or _env_flag("DFLASH_KERNELS_STRICT")


@contextlib.contextmanager
def strict():
    """Inside this context a kernel-cache miss raises :class:`KernelCacheMiss` naming the key.

    Use it after :func:`dflash_kernels.precompile` so that nothing compiles in the middle of a run.
    Process-wide: worker threads obey it while any thread is inside it. Takes no arguments; use it as
    ``with dflash_kernels.strict(): ...`` (``DFLASH_KERNELS_STRICT=1`` turns it on for the whole process).
    """
    global _strict_depth
    with _strict_lock:
        _strict_depth += 1
    try:
        yield
    finally:
        with _strict_lock:
            _strict_depth -= 1


def check_strict(kernel_name: str, key) -> None:
    if is_strict():
        raise KernelCacheMiss(
            f"strict mode: kernel {kernel_name!r} is not compiled for key {key!r}; "
            f"precompile this shape/dtype/device first (dflash_kernels.precompile) or leave strict mode"
        )
