"""The ground truth of the gated delta rule: a literal fp32 recurrence over time.

Slow on purpose (one step per token) and differentiable by plain torch autograd. Never imported by a
fast path; tests and the "reference" backend use it.

Per value head h (served by query/key head ``h // (Hv // Hk)``), with the state ``S`` of shape [K, V]:

    S_t = exp(g_t) * S_{t-1}                                  (decay first)
    S_t = S_t + beta_t * k_t (v_t - S_t^T k_t)^T              (delta rule write)
    o_t = scale * S_t^T q_t

the convention of fla's ``naive_recurrent_gated_delta_rule`` and HF transformers'
``torch_recurrent_gated_delta_rule``. fla's in-kernel options are applied to the inputs first, in fp32:
the raw gate's decay (``naive_gdn_gate``), beta's sigmoid, the V-first state layout.
"""

import torch
import torch.nn.functional as F

__all__ = ["naive_recurrent_gated_delta_rule", "naive_l2norm", "naive_gdn_gate"]


def naive_gdn_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias=None) -> torch.Tensor:
    """The log decay ``-exp(A_log) * softplus(g + dt_bias)`` of the raw gate g [..., Hv] (A_log and dt_bias hold
    Hv elements; softplus with torch's default threshold 20, as fla's kernels). Computed in fp64 and returned
    in fp32, so a large A_log with a very negative g (exp(A_log) past fp32's range, softplus below it) gives
    the finite decay of the math."""
    x = g.double()
    if dt_bias is not None:
        x = x + dt_bias.double().reshape(-1)
    return (-A_log.double().reshape(-1).exp() * F.softplus(x)).float()


def naive_l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, the normalization fla and HF apply to q and k."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _one_sequence(q, k, v, g, beta, scale, state):
    """q, k [T, Hv, K]; v [T, Hv, V]; g, beta [T, Hv]; state [Hv, K, V]; all fp32."""
    outputs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", state, k[t])
        delta = beta[t][:, None] * (v[t] - predicted)
        state = state + k[t][:, :, None] * delta[:, None, :]
        outputs.append(scale * torch.einsum("hkv,hk->hv", state, q[t]))
    if not outputs:  # an empty sequence of a packed batch: the state passes through
        return q.new_zeros(0, state.shape[0], state.shape[2]), state
    return torch.stack(outputs, 0), state


def naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     cu_seqlens=None, *, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                                     state_v_first=False):
    """Reference for ``chunk_gated_delta_rule`` (same arguments, same shapes).

    Args:
        q, k: [B, T, Hk, K]. v: [B, T, Hv, V]. g (log decay), beta: [B, T, Hv].
        initial_state: [N, Hv, K, V], N = B, or N = len(cu_seqlens) - 1 with cu_seqlens (then B = 1).
        use_gate_in_kernel: g is the raw gate, the decay ``naive_gdn_gate(g, A_log, dt_bias)``.
        use_beta_sigmoid_in_kernel: beta holds logits, beta = sigmoid(logits), times 2 with
            allow_neg_eigval.
        state_v_first: initial and final states are [N, Hv, V, K].
    Returns:
        o [B, T, Hv, V] and final_state [N, Hv, K, V] (or [N, Hv, V, K]; or None), both fp32.
    """
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    if scale is None:
        scale = K ** -0.5
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_gate_in_kernel:
        g = naive_gdn_gate(g, A_log, dt_bias)
    if use_beta_sigmoid_in_kernel:
        beta = beta.sigmoid() * (2.0 if allow_neg_eigval else 1.0)
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)
    if use_qk_l2norm_in_kernel:
        q, k = naive_l2norm(q), naive_l2norm(k)
    group = Hv // Hk
    q = q.repeat_interleave(group, dim=2)
    k = k.repeat_interleave(group, dim=2)
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        bounds = cu_seqlens.tolist()
        spans = [(0, bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]
    outputs, finals = [], []
    for n, (b, start, end) in enumerate(spans):
        if initial_state is not None:
            state = initial_state[n].float()
        else:
            state = q.new_zeros(Hv, K, V)
        o, state = _one_sequence(q[b, start:end], k[b, start:end], v[b, start:end],
                                 g[b, start:end], beta[b, start:end], scale, state)
        outputs.append(o)
        finals.append(state)
    if not spans:  # an empty batch (B = 0): empty results, still connected to v for autograd
        o, finals = v * 0.0, [q.new_zeros(0, Hv, K, V)]
    elif cu_seqlens is None:
        o = torch.stack(outputs, 0)
    else:
        o = torch.cat(outputs, 0)[None]
    final_state = torch.cat([f[None] for f in finals] if spans else finals, 0) if output_final_state else None
    if final_state is not None and state_v_first:
        final_state = final_state.transpose(-1, -2).contiguous()
    return o, final_state
