"""Plain fp32 PyTorch reference of the causal depthwise conv1d. Slow on purpose; never on a fast path."""

import torch
import torch.nn.functional as F

__all__ = ["naive_causal_conv1d", "naive_causal_conv1d_update"]


def naive_causal_conv1d(x, weight, bias=None, activation=None, seq_idx=None, initial_states=None,
                        return_final_states=False):
    """y[b, d, t] = act(bias[d] + sum_i weight[d, i] * x[b, d, t - (W-1-i)]), in fp32.

    x ``[B, D, T]``, weight ``[D, W]``, seq_idx ``[B, T]``, initial_states ``[B, D, W-1]``.
    Sources before t = 0 read ``initial_states``; with ``seq_idx`` a source counts only when its
    sequence id equals the target's (times before 0 carry the id of t = 0). Differentiable.
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
        term = weight[:, i].float()[None, :, None] * src
        if seq_idx is not None:
            same = (seq[:, i:i + T] == seq_idx.long())[:, None, :]
            term = term * same
        y = y + term
    if bias is not None:
        y = y + bias.float()[None, :, None]
    if activation in ("silu", "swish"):
        y = F.silu(y)
    y = y.to(dtype)
    if return_final_states:
        final = full[:, :, -(W - 1):].to(dtype)
        return y, final
    return y


def naive_causal_conv1d_update(x, conv_state, weight, bias=None, activation=None):
    """Decode reference: x ``[B, D]`` or ``[B, D, L]``; updates ``conv_state [B, D, S]`` in place."""
    squeeze = x.dim() == 2
    if squeeze:
        x = x.unsqueeze(-1)
    B, D, L = x.shape
    W = weight.shape[1]
    S = conv_state.shape[2]
    full = torch.cat([conv_state.float(), x.float()], dim=2)  # [B, D, S + L]
    outs = []
    for l in range(L):
        window = full[:, :, S + l - (W - 1):S + l + 1]  # W values ending at x_l
        y = (window * weight.float()[None]).sum(-1)
        if bias is not None:
            y = y + bias.float()[None]
        if activation in ("silu", "swish"):
            y = F.silu(y)
        outs.append(y)
    conv_state.copy_(full[:, :, L:].to(conv_state.dtype))
    out = torch.stack(outs, dim=-1).to(x.dtype)
    return out.squeeze(-1) if squeeze else out
