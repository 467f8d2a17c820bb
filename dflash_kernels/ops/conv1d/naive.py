"""Plain fp32 PyTorch reference of the causal depthwise conv1d. Slow on purpose; never on a fast path."""

import torch
import torch.nn.functional as F

__all__ = ["naive_causal_conv1d", "naive_causal_conv1d_update"]


def naive_causal_conv1d(x, weight, bias=None, activation=None, seq_idx=None, initial_states=None,
                        return_final_states=False):
    """y[b, d, t] = act(bias[d] + sum_i weight[d, i] * x[b, d, t - (W-1-i)]), in fp32.

    x ``[B, D, T]``, weight ``[D, W]``, seq_idx ``[B, T]``, initial_states ``[B, D, W-1]``.
    Sources before t = 0 read ``initial_states``; with ``seq_idx`` a source counts only when its
    sequence id equals the target's (times before 0 carry the id of t = 0), and a negative id marks
    padding, where the output is 0. Differentiable.
    Returns y in x's dtype (and the final states ``[B, D, W-1]`` when asked).
    """
    dtype = x.dtype
    B, D, T = x.shape
    W = weight.shape[1]
    xf = x.float()
    if initial_states is not None:
        past = initial_states.float()
    else:
        past = xf.new_zeros(B, D, W - 1)
    full = torch.cat([past, xf], dim=2)  # time t of x sits at index t + W - 1
    if seq_idx is not None:
        seq = torch.cat([seq_idx[:, :1].expand(B, W - 1), seq_idx], dim=1).long()
    y = xf.new_zeros(B, D, T)
    for i in range(W):
        src = full[:, :, i:i + T]  # x[t - (W-1-i)]
        if seq_idx is not None:  # selected before the product: a NaN / Inf of another sequence stays out
            same = ((seq[:, i:i + T] == seq_idx.long()) & (seq_idx >= 0))[:, None, :]
            src = torch.where(same, src, 0.0)
        y = y + weight[:, i].float()[None, :, None] * src
    if bias is not None:
        y = y + bias.float()[None, :, None]
    if activation in ("silu", "swish"):
        y = F.silu(y)
    if seq_idx is not None:  # a negative id marks padding: output 0 there, no gradient through it
        y = torch.where((seq_idx >= 0)[:, None, :], y, 0.0)
    y = y.to(dtype)
    if return_final_states:
        final = full[:, :, -(W - 1):].to(dtype)
        return y, final
    return y


def naive_causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                               conv_state_indices=None):
    """Decode reference: x ``[B, D]`` or ``[B, D, L]``; updates ``conv_state`` in place.

    ``conv_state`` is ``[B, D, S]`` (S >= W-1), or with ``conv_state_indices`` ``[B]`` a pool
    ``[N, D, S]`` of which row b uses ``conv_state[conv_state_indices[b]]`` (a negative index: padding,
    output 0, no state read or written). Without ``cache_seqlens`` the state holds the last S inputs
    and is shifted by L; with ``cache_seqlens`` ``[B]`` it is a circular buffer, not shifted: the L new
    inputs go to ``(cache_seqlens + l) % S`` and the W-1 inputs before them are read at
    ``(cache_seqlens - (W-1) + j) % S``.
    """
    squeeze = x.dim() == 2
    if squeeze:
        x = x.unsqueeze(-1)
    B, D, L = x.shape
    W = weight.shape[1]
    S = conv_state.shape[2]
    out = torch.zeros(B, D, L, dtype=torch.float32, device=x.device)
    for b in range(B):
        row = int(conv_state_indices[b]) if conv_state_indices is not None else b
        if row < 0:
            continue
        state = conv_state[row].float()  # [D, S]
        xb = x[b].float()
        if cache_seqlens is None:
            past = state[:, S - (W - 1):]
            new_state = torch.cat([state, xb], dim=1)[:, L:]
        else:
            c = int(cache_seqlens[b])
            past = state[:, [(c - (W - 1) + j) % S for j in range(W - 1)]]
            new_state = state.clone()
            for l in range(L):
                new_state[:, (c + l) % S] = xb[:, l]
        full = torch.cat([past, xb], dim=1)  # [D, W-1+L]: input l sits at W-1+l
        for l in range(L):
            y = (full[:, l:l + W] * weight.float()).sum(-1)
            if bias is not None:
                y = y + bias.float()
            if activation in ("silu", "swish"):
                y = F.silu(y)
            out[b, :, l] = y
        conv_state[row].copy_(new_state.to(conv_state.dtype))
    out = out.to(x.dtype)
    return out.squeeze(-1) if squeeze else out
