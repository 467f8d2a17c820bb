"""causal_conv1d / causal_conv1d_update as a drop-in for causal-conv1d (1.5+ semantics), on every backend.

- ``seq_idx`` entries of -1 mark padding: output 0 there, no gradient to or from padding;
- ``causal_conv1d_update`` with ``cache_seqlens`` (circular state) and ``conv_state_indices`` (a state
  pool gathered per row, -1 a padding row), x ``[B, D]`` or ``[B, D, L]``, channel-last views;
- fp32 weight and bias beside bf16 / fp16 x (output in x's dtype, gradients in each input's dtype);
- initial / final states on channel-last views;
- an expanded or overlapping ``conv_state`` is refused.

Everything is checked against the fp32 references written below (plain torch, independent of the
library's naive.py). CPU: backends ``interpret`` (TRITON_INTERPRET=1) and ``reference`` at small odd
sizes; ``gpu``-marked tests: ``triton``, ``cuda`` (when the extension is built; its update with
``cache_seqlens`` / ``conv_state_indices`` runs the Triton kernel by design) and ``reference`` at real
sizes.
"""

import pytest
import torch
import torch.nn.functional as F

import dflash_kernels as dk
from dflash_kernels.ops.conv1d import conv1d as conv_mod
from dflash_kernels.ops.conv1d import cuda as conv_cuda
from dflash_kernels.runtime import settings
from tests.helpers import device, rel_err


# ------------------------------------------------------------------------------------ fp32 references
def ref_conv(x, w, b=None, silu=True, seq_idx=None, init=None):
    """y[t] = act(b + sum_i w[i] x[t-(W-1-i)]), a source counting only in t's sequence; 0 at padding."""
    x, w = x.float(), w.float()
    B, D, T = x.shape
    W = w.shape[1]
    xp = torch.cat([init.float() if init is not None else x.new_zeros(B, D, W - 1), x], 2)
    y = x.new_zeros(B, D, T) + (b.float()[None, :, None] if b is not None else 0)
    if seq_idx is not None:
        sp = torch.cat([seq_idx[:, :1].expand(B, W - 1), seq_idx], 1).long()
    for i in range(W):
        src = xp[:, :, i:i + T]
        if seq_idx is not None:
            src = src * (sp[:, i:i + T] == seq_idx.long())[:, None, :]
        y = y + w[:, i][None, :, None] * src
    y = F.silu(y) if silu else y
    if seq_idx is not None:
        y = y * (seq_idx >= 0)[:, None, :]
    return y, xp[:, :, T:]  # output, final states (the last W-1 inputs)


def ref_update(x, state, w, b=None, silu=True, cache_seqlens=None, indices=None):
    """Returns (y fp32 with x's shape, the state afterwards); ``state`` is not modified."""
    squeeze = x.dim() == 2
    x3 = (x.unsqueeze(-1) if squeeze else x).float()
    B, D, L = x3.shape
    W, S = w.shape[1], state.shape[2]
    new = state.clone().float()
    y = torch.zeros(B, D, L)
    for r in range(B):
        row = int(indices[r]) if indices is not None else r
        if row < 0:
            continue
        s = state[row].float().cpu()
        xr = x3[r].cpu()
        if cache_seqlens is None:
            past, after = s[:, S - (W - 1):], torch.cat([s, xr], 1)[:, L:]
        else:
            c = int(cache_seqlens[r])
            past, after = s[:, [(c - (W - 1) + j) % S for j in range(W - 1)]], s.clone()
            for l in range(L):
                after[:, (c + l) % S] = xr[:, l]
        full = torch.cat([past, xr], 1)
        for l in range(L):
            v = (full[:, l:l + W] * w.float().cpu()).sum(1) + (b.float().cpu() if b is not None else 0)
            y[r, :, l] = F.silu(v) if silu else v
        new[row] = after.to(new.device)
    y = y.to(x.device)
    return (y.squeeze(-1) if squeeze else y), new


# ------------------------------------------------------------------------------------ backends
CPU_BACKENDS = ["interpret", "reference"]
GPU_BACKENDS = ["triton", "cuda", "reference"]


def _use(backend):
    if backend == "interpret" and not settings.interpreting():
        pytest.skip("backend 'interpret' needs TRITON_INTERPRET=1")
    if backend == "cuda" and not conv_cuda.available():
        pytest.skip("dflash_kernels._C is not built")
    dk.set_backend("conv1d", backend)


@pytest.fixture(params=CPU_BACKENDS)
def cpu_backend(request):
    if torch.cuda.is_available():
        pytest.skip("CPU test")
    _use(request.param)
    yield request.param
    dk.set_backend("conv1d", "auto")


@pytest.fixture(params=GPU_BACKENDS)
def gpu_backend(request, monkeypatch):
    _use(request.param)
    if request.param == "cuda":  # the extension's forward and backward must run, never Triton's
        def no_triton(*args, **kwargs):
            raise AssertionError("a Triton conv launcher ran while backend 'cuda' was forced")
        monkeypatch.setattr(conv_mod, "_triton_fwd", no_triton)
        monkeypatch.setattr(conv_mod, "_triton_bwd", no_triton)
    yield request.param
    dk.set_backend("conv1d", "auto")


def _tol(dtype):
    return {torch.float32: 1e-5, torch.bfloat16: 2 * 2 ** -8, torch.float16: 2 * 2 ** -11}[dtype]


def _close(name, got, ref, dtype):
    err = rel_err(got.float(), ref.float())
    assert err <= _tol(dtype), f"{name}: relative error {err:.3g} > {_tol(dtype):.3g}"


# ------------------------------------------------------------------------------------ seq_idx padding
def _padded_seq(B, T, dev):
    """Packed sequences with padding (-1) at the start of row 0, between sequences and at the end."""
    seq = torch.zeros(B, T, dtype=torch.int32)
    for r in range(B):
        cuts = sorted(torch.randperm(T - 2)[:4].add(1).tolist())
        ids = torch.zeros(T, dtype=torch.int32)
        for k, c in enumerate(cuts):
            ids[c:] = k + 1
        ids[cuts[1]:cuts[1] + 3] = -1  # padding between two sequences
        ids[T - 2:] = -1  # padding at the end
        if r == 0:
            ids[:2] = -1  # padding at the start
        seq[r] = ids
    return seq.to(dev)


def _check_seq_padding(B, D, T, W, dtype, channel_last, wdtype=None, init=False):
    dev = device()
    wdtype = wdtype or dtype
    if channel_last:
        x = torch.randn(B, T, D, device=dev, dtype=dtype).transpose(1, 2).requires_grad_()
    else:
        x = torch.randn(B, D, T, device=dev, dtype=dtype, requires_grad=True)
    w = (torch.randn(D, W, device=dev, dtype=wdtype) / W).requires_grad_()
    b = torch.randn(D, device=dev, dtype=wdtype, requires_grad=True)
    seq = _padded_seq(B, T, dev)
    init_states = torch.randn(B, D, W - 1, device=dev, dtype=dtype, requires_grad=True) if init else None
    y = dk.causal_conv1d(x, w, b, "silu", seq_idx=seq, initial_states=init_states)
    assert y.dtype == dtype and y.shape == x.shape
    pad = (seq < 0)[:, None, :].expand_as(y)
    assert torch.all(y[pad] == 0), "output at padding positions"
    dy = torch.randn(B, D, T, device=dev, dtype=dtype)
    leaves = (x, w, b) + ((init_states,) if init else ())
    grads = torch.autograd.grad(y, leaves, dy)
    assert grads[1].dtype == wdtype and grads[2].dtype == wdtype
    assert torch.all(grads[0][pad] == 0), "dx at padding positions"

    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    y_ref, _ = ref_conv(ref_leaves[0], ref_leaves[1], ref_leaves[2], True, seq, ref_leaves[3] if init else None)
    ref_grads = torch.autograd.grad(y_ref, ref_leaves, dy.float())
    _close("y", y, y_ref, dtype)
    for name, g, r in zip(["dx", "dweight", "dbias", "dinitial_states"], grads, ref_grads):
        _close(name, g, r, dtype)

    # Padding inputs reach no output and dy at padding reaches no gradient.
    x2 = x.detach().clone()
    x2[pad] += 7.0
    dy2 = dy.clone()
    dy2[pad] = 3.0
    y2 = dk.causal_conv1d(x2.requires_grad_(), w, b, "silu", seq_idx=seq, initial_states=init_states)
    assert torch.equal(y2, y), "padding inputs changed an output"
    grads2 = torch.autograd.grad(dk.causal_conv1d(x, w, b, "silu", seq_idx=seq, initial_states=init_states),
                                 leaves, dy2)
    for name, g, g2 in zip(["dx", "dweight", "dbias", "dinitial_states"], grads, grads2):
        assert torch.equal(g, g2), f"{name}: dy at padding changed it"


@pytest.mark.parametrize("W,channel_last,dtype", [(4, False, torch.float32), (3, True, torch.float32),
                                                 (2, False, torch.bfloat16), (4, True, torch.bfloat16)],
                         ids=lambda v: str(v))
def test_seq_idx_padding(cpu_backend, W, channel_last, dtype):
    _check_seq_padding(2, 13, 45, W, dtype, channel_last, init=W == 4)


@pytest.mark.gpu
@pytest.mark.parametrize("channel_last", [False, True], ids=["cf", "cl"])
@pytest.mark.parametrize("W", [2, 3, 4], ids=lambda w: f"W{w}")
def test_seq_idx_padding_gpu(gpu_backend, W, channel_last):
    _check_seq_padding(2, 1040, 4099, W, torch.bfloat16, channel_last)
    _check_seq_padding(1, 333, 2053, W, torch.float32, channel_last, init=True)


# ------------------------------------------------------------------------------------ mixed dtypes
def _check_mixed(B, D, T, W, dtype, channel_last, init_final):
    dev = device()
    if channel_last:
        x = torch.randn(B, T, D, device=dev, dtype=dtype).transpose(1, 2).requires_grad_()
    else:
        x = torch.randn(B, D, T, device=dev, dtype=dtype, requires_grad=True)
    w = (torch.randn(D, W, device=dev) / W).requires_grad_()  # fp32
    b = torch.randn(D, device=dev, requires_grad=True)  # fp32
    init = None
    if init_final:
        init_btd = torch.randn(B, W - 1, D, device=dev, dtype=dtype)
        init = (init_btd.transpose(1, 2) if channel_last else init_btd.transpose(1, 2).contiguous()).requires_grad_()
    out = dk.causal_conv1d(x, w, b, "silu", initial_states=init, return_final_states=init_final)
    y, final = out if init_final else (out, None)
    assert y.dtype == dtype and y.shape == x.shape
    leaves = (x, w, b) + ((init,) if init_final else ())
    dy = torch.randn_like(y)
    outs, gouts = [y], [dy]
    if init_final:
        dfinal = torch.randn_like(final)
        outs.append(final)
        gouts.append(dfinal)
    grads = torch.autograd.grad(outs, leaves, gouts)
    for g, leaf in zip(grads, leaves):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    y_ref, final_ref = ref_conv(ref_leaves[0], ref_leaves[1], ref_leaves[2], True, None,
                                ref_leaves[3] if init_final else None)
    ref_outs = [y_ref] + ([final_ref] if init_final else [])
    ref_grads = torch.autograd.grad(ref_outs, ref_leaves, [g.float() for g in gouts])
    _close("y", y, y_ref, dtype)
    if init_final:
        _close("final_states", final, final_ref, dtype)
    for name, g, r in zip(["dx", "dweight", "dbias", "dinitial_states"], grads, ref_grads):
        _close(name, g, r, dtype)


@pytest.mark.parametrize("channel_last,init_final", [(False, False), (True, True), (False, True)],
                         ids=["cf", "cl-states", "cf-states"])
def test_fp32_weight_with_bf16_x(cpu_backend, channel_last, init_final):
    _check_mixed(2, 11, 37, 4, torch.bfloat16, channel_last, init_final)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("channel_last,init_final", [(False, False), (True, True), (False, True)],
                         ids=["cf", "cl-states", "cf-states"])
def test_fp32_weight_with_half_x_gpu(gpu_backend, dtype, channel_last, init_final):
    _check_mixed(2, 1000, 3001, 4, dtype, channel_last, init_final)


# ------------------------------------------------------------------------------------ decode update
def _check_update(B, D, L, S, W, dtype, circular, pool, squeeze=False, channel_last=False, wdtype=None, steps=2):
    dev = device()
    wdtype = wdtype or dtype
    n_rows = B + 3 if pool else B
    if channel_last:  # x a view of [B, L, D], the state a view of [N, S, D]
        x_all = torch.randn(steps, B, L, D, device=dev, dtype=dtype).transpose(2, 3)
        state = torch.randn(n_rows, S, D, device=dev, dtype=dtype).transpose(1, 2)
    else:
        x_all = torch.randn(steps, B, D, L, device=dev, dtype=dtype)
        state = torch.randn(n_rows, D, S, device=dev, dtype=dtype)
    w = torch.randn(D, W, device=dev, dtype=wdtype) / W
    b = torch.randn(D, device=dev, dtype=wdtype)
    seqlens = torch.randint(0, 3 * S, (B,), device=dev, dtype=torch.int32) if circular else None
    indices = None
    if pool:
        perm = torch.randperm(n_rows)[:B].to(torch.int32)
        perm[B // 2] = -1  # a padding row
        indices = perm.to(dev)
    for step in range(steps):  # consecutive calls: the state each call leaves is the next one's input
        x = x_all[step]
        if squeeze:
            x = x[:, :, 0]
        y_ref, state_ref = ref_update(x, state, w, b, True, seqlens, indices)
        untouched = state.clone()
        y = dk.causal_conv1d_update(x, state, w, b, "silu", cache_seqlens=seqlens, conv_state_indices=indices)
        assert y.dtype == dtype and y.shape == x.shape
        _close("y", y, y_ref, dtype)
        _close("conv_state", state, state_ref, dtype)
        if pool:
            pad_row = B // 2
            assert torch.all(y[pad_row] == 0), "output of a padding row"
            used = set(int(i) for i in indices.tolist() if i >= 0)
            for r in range(n_rows):
                if r not in used:
                    assert torch.equal(state[r], untouched[r]), f"conv_state row {r} is not used but changed"
        if circular:
            seqlens = seqlens + (1 if squeeze else L)


UPDATE_CASES = [
    # (B, D, L, S, W, circular, pool, squeeze, channel_last)
    (3, 13, 1, 3, 4, True, False, True, False),
    (3, 13, 3, 7, 4, True, False, False, False),
    (4, 9, 2, 5, 3, True, True, False, False),
    (4, 9, 1, 4, 2, False, True, True, False),
    (3, 13, 3, 6, 4, False, True, False, True),
    (3, 13, 2, 5, 4, True, True, False, True),
    (2, 7, 4, 3, 4, False, False, False, True),
]


@pytest.mark.parametrize("B,D,L,S,W,circular,pool,squeeze,channel_last", UPDATE_CASES, ids=lambda v: str(v))
def test_update_circular_and_pool(cpu_backend, B, D, L, S, W, circular, pool, squeeze, channel_last):
    _check_update(B, D, L, S, W, torch.float32, circular, pool, squeeze, channel_last)


@pytest.mark.parametrize("circular,pool", [(True, True), (False, False)], ids=["circular-pool", "plain"])
def test_update_fp32_weight_with_bf16_x(cpu_backend, circular, pool):
    _check_update(3, 13, 2, 5, 4, torch.bfloat16, circular, pool, wdtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("B,D,L,S,W,circular,pool,squeeze,channel_last", [
    (64, 4096, 1, 4, 4, True, True, True, False),
    (33, 2560, 3, 8, 4, True, True, False, False),
    (17, 1000, 2, 5, 3, False, True, False, True),
    (16, 4096, 1, 3, 4, False, False, True, False),
    (16, 2048, 4, 6, 4, True, False, False, True),
], ids=lambda v: str(v))
def test_update_circular_and_pool_gpu(gpu_backend, B, D, L, S, W, circular, pool, squeeze, channel_last, dtype):
    _check_update(B, D, L, S, W, dtype, circular, pool, squeeze, channel_last)
    _check_update(B, D, L, S, W, dtype, circular, pool, squeeze, channel_last, wdtype=torch.float32)


# ------------------------------------------------------------------------------------ refusals
def test_update_refuses_expanded_or_overlapping_state():
    dev = device()
    x = torch.randn(3, 8, device=dev)
    w = torch.randn(8, 4, device=dev)
    expanded = torch.zeros(1, 8, 4, device=dev).expand(3, 8, 4)
    with pytest.raises(ValueError, match="conv_state"):
        dk.causal_conv1d_update(x, expanded, w)
    overlapping = torch.zeros(40, device=dev).as_strided((3, 8, 4), (4, 1, 1))
    with pytest.raises(ValueError, match="conv_state"):
        dk.causal_conv1d_update(x, overlapping, w)
    # Sliced and permuted views do not overlap and are accepted.
    sliced = torch.zeros(3, 8, 6, device=dev)[:, :, 1:5]
    permuted = torch.zeros(3, 4, 8, device=dev).transpose(1, 2)
    for state in (sliced, permuted):
        dk.causal_conv1d_update(x, state, w)


@pytest.mark.parametrize("kwargs,match", [
    (dict(cache_seqlens=torch.zeros(2, dtype=torch.int32)), "cache_seqlens: expected shape"),
    (dict(cache_seqlens=torch.zeros(3)), "cache_seqlens: dtype"),
    (dict(conv_state_indices=torch.zeros(3, 1, dtype=torch.int32)), "conv_state_indices: expected 1"),
], ids=["seqlens-shape", "seqlens-dtype", "indices-rank"])
def test_update_bad_keywords(kwargs, match):
    x, w, state = torch.randn(3, 8), torch.randn(8, 4), torch.zeros(3, 8, 4)
    with pytest.raises((ValueError, TypeError), match=match):
        dk.causal_conv1d_update(x, state, w, **kwargs)
