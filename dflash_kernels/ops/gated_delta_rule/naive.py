"""The ground truth of the gated delta rule: a literal fp32 recurrence over time.

Slow on purpose (one step per token) and differentiable by plain torch autograd. Never imported by a
fast path; tests and the "reference" backend use it.

Per value head h (served by query/key head ``h // (Hv // Hk)``), with the state ``S`` of shape [K, V]:

    S_t = exp(g_t) * S_{t-1}                                  (decay first)
    S_t = S_t + beta_t * k_t (v_t - S_t^T k_t)^T              (delta rule write)
    o_t = scale * S_t^T q_t

the convention of fla's ``naive_recurrent_gated_delta_rule`` and HF transformers'
``torch_recurrent_gated_delta_rule``.
"""

import torch

__all__ = ["naive_recurrent_gated_delta_rule", "naive_l2norm"]


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
                                     cu_seqlens=None):
    """Reference for ``chunk_gated_delta_rule`` (same arguments, same shapes).

    Args:
        q, k: [B, T, Hk, K]. v: [B, T, Hv, V]. g (log decay), beta: [B, T, Hv].
        initial_state: [N, Hv, K, V], N = B, or N = len(cu_seqlens) - 1 with cu_seqlens (then B = 1).
    Returns:
        o [B, T, Hv, V] and final_state [N, Hv, K, V] (or None), both fp32.
    """
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    if scale is None:
        scale = K ** -0.5
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
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
    if cu_seqlens is None:
        o = torch.stack(outputs, 0)
    else:
        o = torch.cat(outputs, 0)[None]
    final_state = torch.stack(finals, 0) if output_final_state else None
    return o, final_state
