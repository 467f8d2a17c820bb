"""Route a Hugging Face hybrid model's Gated DeltaNet and short-conv calls through dflash_kernels.

Qwen3.5 / Qwen3-Next linear-attention layers call four functions of their modeling module by global
name: ``causal_conv1d_fn``, ``causal_conv1d_update``, ``torch_chunk_gated_delta_rule`` and
``torch_recurrent_gated_delta_rule`` (transformers' torch fallbacks, or fla / causal-conv1d when
installed). :func:`use_dflash_kernels` replaces those globals in the modeling modules of the given
model with adapters onto :func:`dflash_kernels.causal_conv1d`, :func:`~dflash_kernels.causal_conv1d_update`,
:func:`~dflash_kernels.chunk_gated_delta_rule` and :func:`~dflash_kernels.fused_recurrent_gated_delta_rule`
(same layouts: ``[B, D, T]`` for the conv, ``[B, T, H, K]`` for the delta rule).

With ``elementwise=True`` (opt-in until these routes are measured on a GPU) the same modules'
elementwise chains are routed too, each only where transformers' source has the exact formula the op
computes (checked on the source text, so a changed formula is left alone):

- ``*RMSNorm.forward`` of the ``x_hat * (1.0 + weight)`` form (Qwen3.5 / Qwen3-Next, fp32 inside,
  one rounding) -> :func:`dflash_kernels.ops.rms_norm.rms_norm` with ``offset=1.0``;
- ``*MLP.forward`` of the ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` form -> the same with
  :func:`dflash_kernels.ops.swiglu.swiglu` when the activation is SiLU (else transformers' own code);
- ``apply_rotary_pos_emb`` (rotate-half, partial rotary when ``cos`` is narrower than the head) ->
  :func:`dflash_kernels.ops.rope.apply_rope` on q and k (fp32 math, one rounding; transformers rounds
  after each op in the activation dtype, so low-precision results differ by that rounding).

- ``*RMSNormGated.forward`` of the norm-then-``weight * x_hat.to(input_dtype)``-then-SiLU-gate form (the GDN
  layers' output norm) -> :func:`dflash_kernels.ops.rms_norm.rms_norm_gated` with ``round_normed=True``
  (transformers' roundings, in one pass).

With ``gdn_layers=True`` (opt-in) the Qwen3.5 GDN layer's cache-less forward is replaced by one that gives
the kernels q and k at their own head count (transformers up to 5.2x copies them to the value heads with
``repeat_interleave``) and the raw gate and beta logits, the decay and ``sigmoid`` computed inside the
kernels (checked on the source text like the routes above).

The replacement is per modeling module, so it applies to every model of that architecture in the
process; :meth:`KernelRouting.undo` restores transformers' functions (those that call patched).
"""

import inspect
import sys
import threading

import torch

import dflash_kernels as dk
from dflash_kernels.ops.rms_norm import rms_norm as _rms_norm
from dflash_kernels.ops.rms_norm import rms_norm_gated as _rms_norm_gated
from dflash_kernels.ops.rope import apply_rope as _apply_rope
from dflash_kernels.ops.swiglu import swiglu as _swiglu

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

def _make_rope(original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        """transformers' ``apply_rotary_pos_emb`` on dflash_kernels: q, k ``[B, H, T, D]``
        (``unsqueeze_dim=1``) or ``[B, T, H, D]`` (2), cos / sin ``[B, T, R]``; returns views in the
        caller's layout. Other layouts run transformers' function."""
        if cos.dim() != 3 or unsqueeze_dim not in (1, 2) or q.dim() != 4 or k.dim() != 4:
            return original(q, k, cos, sin, unsqueeze_dim)
        if unsqueeze_dim == 1:
            return (_apply_rope(q.transpose(1, 2), cos, sin).transpose(1, 2),
                    _apply_rope(k.transpose(1, 2), cos, sin).transpose(1, 2))
        return _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
    apply_rotary_pos_emb.dflash_kernels_route = True
    return apply_rotary_pos_emb


def _rms_norm_1p_forward(self, x):
    return _rms_norm(x, self.weight, self.eps, 1.0)


def _rms_norm_gated_forward(self, hidden_states, gate):
    if getattr(self, "activation", "silu") not in ("silu", "swish"):
        return _originals[(type(self).__module__, type(self).__name__ + ".forward")](self, hidden_states, gate)
    return _rms_norm_gated(hidden_states, gate, self.weight, self.variance_epsilon, 0.0, round_normed=True)


# transformers' RMSNormGated (Qwen3.5 / Qwen3-Next), line by line: what rms_norm_gated(round_normed=True) computes
_GATED_NORM_SOURCE = ("hidden_states = hidden_states.to(torch.float32)",
                      "variance = hidden_states.pow(2).mean(-1, keepdim=True)",
                      "hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)",
                      "hidden_states = self.weight * hidden_states.to(input_dtype)",
                      "hidden_states = hidden_states * ACT2FN[self.activation](gate.to(torch.float32))",
                      "return hidden_states.to(input_dtype)")


def _mlp_forward(self, x):
    act = getattr(getattr(self, "config", None), "hidden_act", None)
    if act not in ("silu", "swish"):
        return _originals[(type(self).__module__, type(self).__name__ + ".forward")](self, x)
    return self.down_proj(_swiglu(self.gate_proj(x), self.up_proj(x)))


# transformers' Qwen3.5 GDN layer, the lines the training route below computes the same way. What it leaves
# out: the copy of q and k to the value heads (versions up to 5.2x; the kernels take Hk < Hv heads as they
# are) and the decay and beta's elementwise chain (the kernels compute both from a, b, A_log and dt_bias).
_GDN_LAYER_SOURCE = ("hidden_states = apply_mask_to_padding_states(hidden_states, attention_mask)",
                     "mixed_qkv = self.in_proj_qkv(hidden_states)",
                     "z = self.in_proj_z(hidden_states)",
                     "b = self.in_proj_b(hidden_states)",
                     "a = self.in_proj_a(hidden_states)",
                     "beta = b.sigmoid()",
                     "g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)",
                     "use_qk_l2norm_in_kernel=True,",
                     "core_attn_out = self.norm(core_attn_out, z)",
                     "output = self.out_proj(core_attn_out)")


def _make_gdn_layer_forward(module, original):
    """The GDN layer's forward without a cache (training, the frozen target's features): q and k given to
    the kernels at their own head count, and the decay ``-exp(A_log) * softplus(a + dt_bias)`` and
    ``beta = sigmoid(b)`` computed inside them (fp32; transformers rounds beta to the activations' dtype)
    instead of by seven elementwise kernels per layer. With a cache (generation): transformers' forward."""
    mask_padding = module.apply_mask_to_padding_states

    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        if cache_params is not None or kwargs.get("cache") is not None:
            return original(self, hidden_states, cache_params, attention_mask, **kwargs)
        hidden_states = mask_padding(hidden_states, attention_mask)
        batch, seq_len, _ = hidden_states.shape
        mixed_qkv = self.in_proj_qkv(hidden_states).transpose(1, 2)
        z = self.in_proj_z(hidden_states)
        b = self.in_proj_b(hidden_states)
        a = self.in_proj_a(hidden_states)
        mixed_qkv = dk.causal_conv1d(mixed_qkv, self.conv1d.weight.squeeze(1), self.conv1d.bias, self.activation,
                                     seq_idx=kwargs.get("seq_idx")).transpose(1, 2)
        q, k, v = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(batch, seq_len, -1, self.head_k_dim)
        k = k.reshape(batch, seq_len, -1, self.head_k_dim)
        v = v.reshape(batch, seq_len, -1, self.head_v_dim)
        o, _ = dk.chunk_gated_delta_rule(q, k, v, a, b, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                         A_log=self.A_log, dt_bias=self.dt_bias, use_beta_sigmoid_in_kernel=True,
                                         cu_seqlens=kwargs.get("cu_seq_lens_q"))
        o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(o.reshape(batch, seq_len, -1))

    hooks = getattr(module, "force_accelerate_hooks", None)  # transformers' offloading hooks on conv1d
    return hooks("conv1d")(forward) if callable(hooks) else forward


def _gdn_layer_routes(module):
    """``[(class, "forward", replacement)]`` for GDN layers whose forward copies q and k to the value heads."""
    routes = []
    for name, obj in sorted(vars(module).items()):
        if (isinstance(obj, type) and issubclass(obj, torch.nn.Module) and obj.__module__ == module.__name__
                and name.endswith("GatedDeltaNet") and "forward" in obj.__dict__
                and hasattr(module, "apply_mask_to_padding_states")
                and all(line in _source(obj.__dict__["forward"]) for line in _GDN_LAYER_SOURCE)):
            routes.append((obj, "forward", _make_gdn_layer_forward(module, obj.__dict__["forward"])))
    return routes


def _source(fn) -> str:
    try:
        return inspect.getsource(inspect.unwrap(fn))
    except (OSError, TypeError):
        return ""


def _elementwise_routes(module):
    """``[(owner, attribute, replacement)]`` for the norms, MLPs and RoPE of ``module`` whose source
    has the exact formula of the op that replaces them."""
    routes = []
    for name, obj in sorted(vars(module).items()):
        if not (isinstance(obj, type) and issubclass(obj, torch.nn.Module) and obj.__module__ == module.__name__):
            continue
        fwd = obj.__dict__.get("forward")
        if fwd is None:
            continue
        src = _source(fwd)
        if name.endswith("RMSNorm") and "output * (1.0 + self.weight.float())" in src and "self._norm(x.float())" in src:
            routes.append((obj, "forward", _rms_norm_1p_forward))
        elif name.endswith("RMSNormGated") and all(line in src for line in _GATED_NORM_SOURCE):
            routes.append((obj, "forward", _rms_norm_gated_forward))
        elif name.endswith("MLP") and "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))" in src:
            routes.append((obj, "forward", _mlp_forward))
    rope = getattr(module, "apply_rotary_pos_emb", None)
    if rope is not None:
        src = _source(rope)
        if "rotate_half(q_rot) * sin" in src or "(rotate_half(q) * sin)" in src:
            routes.append((module, "apply_rotary_pos_emb", _make_rope(rope)))
    return routes


# (module name, attribute path) -> transformers' object, saved at the first patch. An attribute path is
# a global name ("causal_conv1d_fn") or "Class.forward".
_originals = {}
_owners = {}  # the same keys -> (owner object, attribute name)
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
                owner, attr = _owners.pop(key, (sys.modules[key[0]], key[1]))
                if fn is not None:
                    setattr(owner, attr, fn)
            self._patched = []

    def __repr__(self):
        return f"KernelRouting({self.modules})"


def use_dflash_kernels(model, elementwise: bool = False, gdn_layers: bool = False) -> KernelRouting:
    """Make ``model``'s Gated DeltaNet and short causal conv layers (and, with ``elementwise``, its
    ``(1 + w)`` RMSNorms, SiLU MLPs and rotate-half RoPE) run on dflash_kernels.

    Args:
        model: a transformers model (``nn.Module``) with Qwen3.5 / Qwen3-Next style linear-attention
            layers.
        elementwise: also route the norms, MLP activations and RoPE of the same modeling modules.
        gdn_layers: replace the GDN layer's cache-less forward by one that passes q and k at their own
            head count (transformers up to 5.2x copies them to the value heads: a copy of q and k per layer
            that the kernels do not need) and lets the kernels compute the decay and
            beta from the raw gate and logits (seven elementwise kernels less per layer). Opt-in: its
            host work pays off where the forward runs as CUDA graphs (the trainer's rule).

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
            routes = _gdn_layer_routes(module) if gdn_layers else []
            routes += _elementwise_routes(module) if elementwise else []
            for owner, attr, replacement in routes:
                key = (module_name, attr if owner is module else f"{owner.__name__}.{attr}")
                if key in _originals:
                    continue
                _originals[key] = getattr(owner, attr)
                _owners[key] = (owner, attr)
                setattr(owner, attr, replacement)
                patched.append(key)
    return KernelRouting(targets, patched)
