"""The thread-safe kernel runtime every op is built on: per-key compile cache, tuning, backends, dispatch."""

# ``backends`` is the submodule here; the top-level ``dflash_kernels.backends()`` is its report
# function ``backends.backends``.
from dflash_kernels.runtime import backends
from dflash_kernels.runtime.backends import (Op, bucket, cdiv, get_backend, next_pow2, register_op, resolve,
                                             set_backend)
from dflash_kernels.runtime.choice import Choice
from dflash_kernels.runtime.errors import BackendUnavailable, KernelCacheMiss, TuningCacheWarning
from dflash_kernels.runtime.kernel import Config, TritonKernel, cache_info, reset_cache
from dflash_kernels.runtime.precompile import precompile, precompile_recorded, register_precompile
from dflash_kernels.runtime.settings import cache_dir, interpreting, is_strict, strict

if interpreting():
    from dflash_kernels.runtime import interpreter_compat

    interpreter_compat.apply()

__all__ = [
    "BackendUnavailable", "Choice", "Config", "Op", "bucket", "cdiv", "next_pow2", "KernelCacheMiss", "TritonKernel",
    "backends", "cache_dir", "cache_info", "get_backend", "is_strict", "precompile", "precompile_recorded", "register_op", "register_precompile",
    "reset_cache", "resolve", "set_backend", "strict", "TuningCacheWarning",
]
