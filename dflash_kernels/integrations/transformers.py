"""Route a Hugging Face hybrid model's Gated DeltaNet and short-conv calls through dflash_kernels.

Qwen3.5 / Qwen3-Next linear-attention layers call four functions of their modeling module by global
name: ``causal_conv1d_fn``, ``causal_conv1d_update``, ``torch_chunk_gated_delta_rule`` and
``torch_recurrent_gated_delta_rule`` (transformers' torch fallbacks, or fla / causal-conv1d when
installed). :func:`use_dflash_kernels` replaces those globals in the modeling modules of the given
model with adapters onto :func:`dflash_kernels.causal_conv1d`, :func:`~dflash_kernels.causal_conv1d_update`,
:func:`~dflash_kernels.chunk_gated_delta_rule` and :func:`~dflash_kernels.fused_recurrent_gated_delta_rule`
(same layouts: ``[B, D, T]`` for the conv, ``[B, T, H, K]`` for the delta rule).

The replacement is per modeling module, so it applies to every model of that architecture in the
process; :meth:`KernelRouting.undo` restores transformers' functions (those that call patched).
"""

import sys
import threading

import dflash_kernels as dk

__all__ = ["use_dflash_kernels", "KernelRouting"]


def _conv(hidden_states, weight, bias=None, activation=None, **kwargs):
    return dk.causal_conv1d(hidden_states, weight, bias, activation, seq_idx=kwargs.get("seq_idx"))


def _conv_update(hidden_states, conv_state, weight, bias=None, activation=None, **kwargs):
    return dk.causal_conv1d_update(hidden_states, conv_state, weight, bias, activation)


def _chunk(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    # chunk_size is the torch fallback's knob; the kernels use their own chunk length.
    return dk.chunk_gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                     output_final_state=output_final_state,
                                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)


def _recurrent(query, key, value, g, beta, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    return dk.fused_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                               output_final_state=output_final_state,
                                               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                               cu_seqlens=cu_seqlens)


ADAPTERS = {
    "causal_conv1d_fn": _conv,
    "causal_conv1d_update": _conv_update,
    "torch_chunk_gated_delta_rule": _chunk,
    "torch_recurrent_gated_delta_rule": _recurrent,
}

_originals = {}  # (module name, global name) -> transformers' function, saved at the first patch
_lock = threading.Lock()


class KernelRouting:
    """The modeling modules routed through dflash_kernels by one :func:`use_dflash_kernels` call.

    ``undo()`` reverts what that call patched and nothing else: functions an earlier call had already
    routed stay routed (so a helper that routes a model for a while, then undoes, leaves a caller's
    routing in place).
    """

    def __init__(self, modules, patched=()):
        self.modules = sorted(modules)
        self._patched = list(patched)  # (module name, global name) pairs this call replaced

    def undo(self) -> None:
        """Put transformers' own functions back where this call replaced them."""
        with _lock:
            for key in self._patched:
                fn = _originals.pop(key, None)
                if fn is not None:
                    setattr(sys.modules[key[0]], key[1], fn)
            self._patched = []

    def __repr__(self):
        return f"KernelRouting({self.modules})"


def use_dflash_kernels(model) -> KernelRouting:
    """Make ``model``'s Gated DeltaNet and short causal conv layers run on dflash_kernels.

    Args:
        model: a transformers model (``nn.Module``) with Qwen3.5 / Qwen3-Next style linear-attention
            layers.

    Returns:
        A :class:`KernelRouting` whose ``undo()`` restores transformers' functions.

    Raises:
        ValueError: the model has no layer whose modeling module calls these functions.
    """
    names = {type(m).__module__ for m in model.modules()}
    targets = {n for n in names if n in sys.modules and any(hasattr(sys.modules[n], a) for a in ADAPTERS)}
    if not targets:
        raise ValueError(f"model: {type(model).__name__} has no layer that calls causal_conv1d_fn / "
                         f"torch_chunk_gated_delta_rule (Qwen3.5 / Qwen3-Next style); nothing to route")
    patched = []
    with _lock:
        for module_name in targets:
            module = sys.modules[module_name]
            for name, adapter in ADAPTERS.items():
                if hasattr(module, name) and (module_name, name) not in _originals:
                    _originals[(module_name, name)] = getattr(module, name)
                    setattr(module, name, adapter)
                    patched.append((module_name, name))
    return KernelRouting(targets, patched)
