"""Every public op with each tensor argument in every memory layout it may arrive in (issue 46).

A layout is one way a tensor of the same values can lie in memory: a step of 2 along the last dim or an
outer one, a row slice of a wider tensor (``[B, T, H, D]`` as a slice of a ``[B, T, W]`` projection), a
stride-0 (expanded) view, a nonzero storage offset, the two inner dims transposed in memory (head-major
``[B, H, T, D]`` seen as ``[B, T, H, D]``, the conv's channel-last ``[B, T, D]`` seen as ``[B, D, T]``).
Gaps a view skips hold NaN (integers 0), so a kernel that reads past the view's elements shows up.

For each op and layout the result must equal the op called with contiguous clones of the same values:
every output, every gradient (of every argument differentiated in real use) and the arguments updated
in place (documented: ``causal_conv1d_update``'s state, ``fused_adamw_``'s lists), with the elements
around an updated view left as they were; arguments that are only read stay unchanged; outputs and
gradients share memory with no input and with each other. Or the op refuses the layout with a
ValueError / TypeError naming the argument, where it does so on purpose (listed per case). The contiguous
call and each accepted dtype mix are also held to the fp32 reference, as are zero-size calls.

Tests: ``test_layout`` (one argument at a time, fp32), ``test_every_argument_laid_out`` (all arguments in
one layout at once, fp32 and each dtype mix), ``test_against_reference`` (contiguous, every dtype mix and
zero-size), ``test_refused`` (dtype mixes and sizes an op refuses), and the AdamW tests at the end.

Each tensor argument takes each layout that applies to it in one configuration of its op at least (a
``Case``). The interpreter is slow, so a configuration has the fewest batch rows, sequences and heads its
layouts need (B = 2 for batch strides, H = 2 for the head-major layout), and one that exists for a few
arguments (the GDN's gate, its packed sequences) lays out only those (``Case.layout_args``).
"""

import dataclasses
import functools
import re
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F

import dflash_kernels as dk
from dflash_kernels import reference as ref
from dflash_kernels.ops.attention import BlockSparseMask
from dflash_kernels.ops.adamw.naive import naive_adamw_
from tests.helpers import check_close, require_triton_kernels, slow_param
from tests.ops.test_malformed import _gdn, _lce

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
SEED = 46

LAYOUTS = ("step2-last", "step2-outer", "row-slice", "expanded", "expanded-last", "offset", "transposed")
# Layouts whose values are those of the contiguous argument (an expanded view repeats one slice).
SAME_VALUES = ("contiguous", "step2-last", "step2-outer", "row-slice", "offset", "transposed")
OFFSET = 3  # elements before an offset view: 12 bytes in fp32, so the view is not 16-byte aligned either


# ---------------------------------------------------------------------------------------------------
# laying a tensor out


def _outer_dim(t: torch.Tensor) -> Optional[int]:
    """The outermost dim of size > 1 other than the last, or None."""
    return next((d for d in range(t.dim() - 1) if t.shape[d] > 1), None)


def _expand_dim(t: torch.Tensor) -> Optional[int]:
    d = _outer_dim(t)
    return d if d is not None else (t.dim() - 1 if t.dim() and t.shape[-1] > 1 else None)


def _swap_dims(t: torch.Tensor, swap) -> tuple:
    return swap if swap is not None else ((0, 1) if t.dim() == 2 else (1, 2))


def applies(t: torch.Tensor, layout: str, swap=None) -> bool:
    """Whether ``layout`` gives ``t`` a layout other than the contiguous one."""
    n = t.dim()
    if layout == "contiguous":
        return True
    if n == 0 or t.numel() == 0 and layout not in ("step2-last", "offset"):
        return False
    if layout in ("step2-last", "expanded-last"):
        return t.shape[-1] > 1 and (layout == "step2-last" or n >= 2)
    if layout == "step2-outer":
        return _outer_dim(t) is not None
    if layout == "row-slice":
        return n >= 2
    if layout == "expanded":
        return _expand_dim(t) is not None
    if layout == "offset":
        return True
    if layout == "transposed":
        a, b = _swap_dims(t, swap)
        return n >= 2 and t.shape[a] > 1 and t.shape[b] > 1
    raise AssertionError(layout)


def _poisoned(shape, like: torch.Tensor) -> torch.Tensor:
    fill = float("nan") if like.is_floating_point() else 0
    return torch.full(shape, fill, dtype=like.dtype, device=like.device)


def lay_out(t: torch.Tensor, layout: str, swap=None):
    """``(view, base)``: a view laid out as ``layout`` holding ``t``'s values (expanded layouts: the
    values of ``t``'s first slice along the expanded dim, repeated), and the tensor owning its memory."""
    t = t.detach()
    if layout == "contiguous":
        base = t.clone()
        return base, base
    if layout in ("expanded", "expanded-last"):
        d = t.dim() - 1 if layout == "expanded-last" else _expand_dim(t)
        base = t.narrow(d, 0, 1).clone()
        return base.expand(t.shape), base
    if layout == "transposed":
        a, b = _swap_dims(t, swap)
        base = t.transpose(a, b).contiguous()
        return base.transpose(a, b), base
    shape = list(t.shape)
    if layout in ("step2-last", "step2-outer"):
        d = t.dim() - 1 if layout == "step2-last" else _outer_dim(t)
        shape[d] *= 2
        base = _poisoned(shape, t)
        view = base[(slice(None),) * d + (slice(None, None, 2),)]
    elif layout == "row-slice" and t.dim() == 4:  # [B, T, H, D] inside a [B, T, W] projection
        B, T, H, D = shape
        base = _poisoned((B, T, H * D + 5), t)
        view = base[..., 2:2 + H * D].view(B, T, H, D)
    elif layout == "row-slice":
        base = _poisoned(shape[:-1] + [shape[-1] + 3], t)
        view = base[..., 1:1 + shape[-1]]
    elif layout == "offset":
        base = _poisoned((t.numel() + OFFSET,), t)
        view = base[OFFSET:].view(t.shape)
    else:
        raise AssertionError(layout)
    view.copy_(t)
    return view, base


def _covered(view: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """A bool tensor like ``base``: True at the elements ``view`` covers."""
    mask = torch.zeros(base.shape, dtype=torch.bool)
    torch.as_strided(mask, view.shape, view.stride(), view.storage_offset() - base.storage_offset()).fill_(True)
    return mask


# ---------------------------------------------------------------------------------------------------
# comparisons


def _tol(dtype) -> float:
    return {F32: 1e-5, BF16: 1.6e-2, F16: 2e-3}.get(dtype, 0.0)


def assert_same(name: str, got: torch.Tensor, exp: torch.Tensor) -> None:
    """``got`` equals ``exp`` element by element (floats: to a rounding or two of their dtype; a layout
    may change the order of a kernel's sums)."""
    assert got.shape == exp.shape, f"{name}: shape {tuple(got.shape)} != {tuple(exp.shape)}"
    assert got.dtype == exp.dtype, f"{name}: dtype {got.dtype} != {exp.dtype}"
    if not got.is_floating_point():
        assert torch.equal(got, exp), f"{name}: values differ"
        return
    tol = _tol(got.dtype)
    scale = exp.detach().abs().max().item() if exp.numel() else 0.0
    torch.testing.assert_close(got.detach(), exp.detach(), rtol=tol, atol=tol * scale + 1e-30,
                               msg=lambda m: f"{name}: {m}")


def _close_to_reference(name: str, got: torch.Tensor, exp: torch.Tensor, tol: float, row_tol: float) -> None:
    """``check_close`` (tests/helpers.py) on the finite elements; infinities (attention's lse of a row that
    sees no key) must be the reference's, at its positions. An empty result only has its shape."""
    assert got.shape == exp.shape, f"{name}: shape {tuple(got.shape)} != {tuple(exp.shape)}"
    got, exp = got.detach().float(), exp.detach().float()
    inf = exp.isinf()
    if inf.any():
        assert torch.equal(got[inf], exp[inf]), f"{name}: infinities differ from the reference's"
        got, exp = got.masked_fill(inf, 0.0), exp.masked_fill(inf, 0.0)
    if got.numel():
        check_close(name, got, exp, tol, row_tol)


def _span(t: torch.Tensor):
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a.numel() > 0 and b.numel() > 0 and a0 < b1 and b0 < a1


def assert_no_alias(results: dict, inputs: dict) -> None:
    """No two results (outputs, gradients) share memory, and no result shares memory with an input."""
    items = [(n, t) for n, t in results.items() if t is not None and t.numel()]
    for i, (na, a) in enumerate(items):
        for nb, b in items[i + 1:]:
            assert not _overlap(a, b), f"{na} and {nb} share memory"
        for nb, b in inputs.items():
            assert not _overlap(a, b), f"{na} shares memory with the input {nb}"


# ---------------------------------------------------------------------------------------------------
# the cases: one configuration of one op


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    op: str  # the dispatch name whose backend must be the kernels
    build: Callable[[], dict]  # every argument of `call` (tensors contiguous), the same values on every call
    call: Callable[..., tuple]  # the public op; returns its outputs as a tuple (a lone tensor: one output)
    grads: tuple = ()  # the arguments differentiated in real use
    ref: Optional[Callable[..., tuple]] = None  # the fp32 reference, outputs like `call`'s (None: not compared)
    out_dtypes: Optional[Callable[[dict], tuple]] = None  # the documented dtypes of the outputs
    inplace: tuple = ()  # arguments updated in place (documented)
    skip: tuple = ()  # (argument, layout): values the op cannot take (e.g. a constant cu_seqlens)
    refuses: tuple = ()  # (argument, layout, exception, message pattern): refused on purpose
    swap: tuple = ()  # (argument, (a, b)): the dims of its "transposed" layout, where not (1, 2) / (0, 1)
    layouts: bool = True  # run the one-argument-at-a-time layout tests (fp32 cases)
    layout_args: Optional[tuple] = None  # the arguments those tests lay out (default all): a configuration
    # that exists for some arguments (the GDN's gate, its packed sequences) lays out those
    layout_set: tuple = LAYOUTS  # the layouts they take: a configuration that exists for one layout (H > 1
    # for the head-major one) takes that one
    every_argument: bool = True  # run test_every_argument_laid_out
    ref_tol: tuple = (1e-4, 1e-3)  # (whole-tensor, worst-row) relative error against the reference, fp32
    low_tol: tuple = (2e-2, 6e-2)  # the same with bf16 / fp16 tensors

    def tensor_args(self):
        return [n for n, v in self.build().items() if isinstance(v, torch.Tensor)]

    def swap_of(self, name):
        return dict(self.swap).get(name)

    def refusal(self, name, layout):
        return next(((e, m) for a, lo, e, m in self.refuses if a == name and lo == layout), None)


def _seeded(fn):
    @functools.wraps(fn)
    def build():
        torch.manual_seed(SEED)
        return fn()
    return build


def _dtypes_like(*spec):
    """A case's ``out_dtypes``: each entry an argument's name (its dtype) or a dtype."""
    def out_dtypes(args):
        return tuple(args[s].dtype if isinstance(s, str) else s for s in spec)
    return out_dtypes


def _single(fn):
    """An op (or reference) of one output, as a ``call`` returning it in a tuple."""
    def call(**args):
        return (fn(**args),)
    return call


def _float_dtypes(args: dict) -> set:
    return {v.dtype for v in args.values() if isinstance(v, torch.Tensor) and v.is_floating_point()}


# ---------------------------------------------------------------------------------------- attention


def _attn_dflash_build(dtype, B=2):
    N, bs, S, Hq, Hkv, D = 2, 4, 7, 2, 1, 64
    MB = max(B, 1)  # the mask's batch: one mask row serves an empty batch
    return dict(anchors=torch.tensor([[0, 5], [3, 7]])[:MB], valid=torch.tensor([[True, True], [False, True]])[:MB],
                q=torch.randn(B, N * bs, Hq, D, dtype=dtype), k=torch.randn(B, S + N * bs, Hkv, D, dtype=dtype),
                v=torch.randn(B, S + N * bs, Hkv, D, dtype=dtype))


def _attn_dflash_mask(anchors, valid):
    return dk.dflash_block_mask(anchors, 7, 4, valid=valid, kv_tile=16)


def _attn_dflash_call(anchors, valid, q, k, v):
    return dk.block_sparse_attention(q, k, v, _attn_dflash_mask(anchors, valid), return_lse=True)


def _attn_dflash_ref(anchors, valid, q, k, v):
    return ref.naive_block_sparse_attention(q, k, v, _attn_dflash_mask(anchors, valid), return_lse=True)


MASK_FIELDS = ("segments", "seg_count", "tiles", "rev_offsets", "rev_full", "rev_entries")


@functools.lru_cache(maxsize=None)
def _flex_mask() -> BlockSparseMask:
    """A flex mask with partial blocks (a non-empty ``tiles``): sliding-window causal, Tq=20, Tk=23."""
    from torch.nn.attention.flex_attention import create_block_mask

    block_mask = create_block_mask(lambda b, h, q, kv: (kv <= q + 3) & (q - kv < 9), None, None, 20, 23,
                                   device="cpu", BLOCK_SIZE=16)
    return dk.from_flex_block_mask(block_mask, kv_tile=16)


def _attn_fields_build():
    m = _flex_mask()
    return dict(**{f: getattr(m, f).clone() for f in MASK_FIELDS}, q=torch.randn(2, 20, 2, 64),
                k=torch.randn(2, 23, 1, 64), v=torch.randn(2, 23, 1, 64))


def _fields_mask(fields) -> BlockSparseMask:
    """The flex mask with its tensors replaced by ``fields`` (a user assembling a mask from views)."""
    return dataclasses.replace(_flex_mask(), **fields)


def _attn_fields_call(q, k, v, **fields):
    return dk.block_sparse_attention(q, k, v, _fields_mask(fields), return_lse=True)


def _attn_fields_ref(q, k, v, **fields):
    return ref.naive_block_sparse_attention(q, k, v, _fields_mask(fields), return_lse=True)


def _attention_cases():
    # A mask's structure must stay consistent: its fields and the anchors are not repeated by an expansion.
    fixed = tuple((n, lo) for n in MASK_FIELDS + ("anchors",) for lo in ("expanded", "expanded-last"))
    c = dict(grads=("q", "k", "v"), out_dtypes=_dtypes_like("q", F32), skip=fixed)
    dflash = dict(call=_attn_dflash_call, ref=_attn_dflash_ref, **c)
    return [Case("attention-dflash", "attention", _seeded(functools.partial(_attn_dflash_build, F32)),
                 ref_tol=(1e-5, 1e-4), **dflash),
            Case("attention-dflash[bf16]", "attention", _seeded(functools.partial(_attn_dflash_build, BF16)),
                 layouts=False, **dflash),
            Case("attention-dflash[fp16]", "attention", _seeded(functools.partial(_attn_dflash_build, F16)),
                 layouts=False, **dflash),
            Case("attention-flex-fields", "attention", _seeded(_attn_fields_build), call=_attn_fields_call,
                 ref=_attn_fields_ref, ref_tol=(1e-5, 1e-4), layout_args=MASK_FIELDS, **c),
            Case("attention-dflash[B=0]", "attention", _seeded(functools.partial(_attn_dflash_build, F32, B=0)),
                 layouts=False, **dflash)]


# -------------------------------------------------------------------------------- gated delta rule


def _gdn_build(B=2, T=9, Hk=2, Hv=2, K=16, V=16, dtypes=None, initial_state=True, gate=False, l2norm=False,
               varlen=None, cu_dtype=torch.int64):
    """``_gdn``'s q, k, v, g, beta (test_malformed.py) with the options of a configuration. dtypes: per
    argument, default fp32. varlen: the sequence boundaries (then B = 1)."""
    a = _gdn(B=B, T=T, Hk=Hk, Hv=Hv, K=K, V=V)
    N = B
    if gate:
        a["g"] = torch.randn(B, T, Hv)
        a.update(use_gate_in_kernel=True, A_log=torch.randn(Hv) * 0.5, dt_bias=torch.randn(Hv))
    if l2norm:
        a["use_qk_l2norm_in_kernel"] = True
    else:  # unit-norm keys keep the delta rule's write contractive without the in-kernel norm
        a["k"] = F.normalize(a["k"], dim=-1)
    if varlen is not None:
        cu = torch.tensor(varlen, dtype=cu_dtype)
        N = cu.numel() - 1
        a["cu_seqlens"] = cu
        if cu_dtype == torch.int64:  # fla's metadata beside it: the host copy and the 64-token chunk list
            a["cu_seqlens_cpu"] = cu.clone()
            a["chunk_indices"] = torch.tensor([[n, 0] for n in range(N) if varlen[n + 1] > varlen[n]])
    if initial_state:
        a["initial_state"] = torch.randn(N, Hv, K, V) * 0.3
    for name, dt in (dtypes or {}).items():
        a[name] = a[name].to(dt)
    return a


def _gdn_call(fn):
    def call(q, k, v, g, beta, **kw):
        return fn(q, k, v, g, beta, output_final_state=True, **kw)
    return call


def _gdn_ref(q, k, v, g, beta, cu_seqlens_cpu=None, chunk_indices=None, use_qk_l2norm_in_kernel=False,
             initial_state=None, cu_seqlens=None, **kw):
    return ref.naive_recurrent_gated_delta_rule(q, k, v, g, beta, None, initial_state, True, use_qk_l2norm_in_kernel,
                                                cu_seqlens, **kw)


GDN_GRADS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
GDN_FIXED = tuple((n, lo) for n in ("cu_seqlens", "cu_seqlens_cpu", "chunk_indices")
                  for lo in ("expanded", "expanded-last"))
# The state's "transposed" layout is fla's V-first memory ([N, Hv, V, K] seen as [N, Hv, K, V]).
GDN_SWAP = (("initial_state", (2, 3)),)


def _gdn_cases():
    """The interpreter's cost is per sequence and value head (N * Hv): each configuration has the
    fewest that keep its layouts distinct (B = 2 for the batch strides, H = 2 for the head-major ones)."""
    cases = []
    mixes = [("bf16", dict(q=BF16, k=BF16, v=BF16, beta=BF16)),  # g and the state in fp32 (Qwen3-Next)
             ("fp32-qk-bf16-v", dict(v=BF16)),  # fla's fp32 q / k beside bf16 v
             ("bf16-all", dict(q=BF16, k=BF16, v=BF16, g=BF16, beta=BF16, initial_state=BF16)),
             ("gate-bf16", dict(gate=True, dtypes=dict(q=BF16, k=BF16, v=BF16, g=BF16, beta=BF16)))]
    every = ("q", "k", "v", "g", "beta", "initial_state")
    head_major = dict(layout_set=("transposed",), every_argument=False)
    configs = [  # id, sizes and options, the arguments laid out one at a time, options of the case
        ("", dict(B=2, Hk=1, Hv=1), every, dict(every_argument=False)),  # at once: in the l2norm one and the mixes
        ("heads", dict(B=1, Hk=2, Hv=2), every, head_major),
        ("l2norm", dict(B=2, Hk=1, Hv=1, l2norm=True), ("q", "k", "v"), {}),  # q, k, v read in place by row stride
        ("l2norm-heads", dict(B=1, Hk=2, Hv=2, l2norm=True), ("q", "k", "v"), head_major),
        ("gate-gqa", dict(B=1, Hk=1, Hv=2, gate=True, l2norm=True), ("g", "A_log", "dt_bias"), {}),
        ("varlen", dict(B=1, Hk=1, Hv=1, varlen=[0, 4, 9]), ("cu_seqlens", "cu_seqlens_cpu", "chunk_indices"), {}),
        ("varlen-int32", dict(B=1, Hk=1, Hv=1, varlen=[0, 4, 9], cu_dtype=torch.int32), ("cu_seqlens",),
         dict(every_argument=False))]
    for fn, name, grads, out in ((dk.chunk_gated_delta_rule, "gdn-chunk", GDN_GRADS, _dtypes_like("q", F32)),
                                 (dk.fused_recurrent_gated_delta_rule, "gdn-recurrent", (), _dtypes_like("v", F32))):
        common = dict(call=_gdn_call(fn), grads=grads, ref=_gdn_ref, out_dtypes=out, skip=GDN_FIXED, swap=GDN_SWAP)
        for cfg, kw, laid, opts in configs:
            cases.append(Case(f"{name}{'-' + cfg if cfg else ''}", "gdn", _seeded(functools.partial(_gdn_build, **kw)),
                              layout_args=laid, **opts, **common))
        for mix, kw in mixes:
            kw = kw if "dtypes" in kw else dict(dtypes=kw)
            cases.append(Case(f"{name}[{mix}]", "gdn", _seeded(functools.partial(_gdn_build, B=1, Hk=1, Hv=1, **kw)),
                              layouts=False, **common))
        cases.append(Case(f"{name}[fp16,fp32-g-beta]", "gdn", _seeded(functools.partial(
            _gdn_build, B=1, Hk=1, Hv=1, dtypes=dict(q=F16, k=F16, v=F16))), layouts=False, every_argument=False,
            **common))
        cases.append(Case(f"{name}[B=0]", "gdn", _seeded(functools.partial(_gdn_build, B=0)), layouts=False, **common))
        cases.append(Case(f"{name}-varlen[empty-sequence]", "gdn", _seeded(functools.partial(
            _gdn_build, B=1, Hk=1, Hv=1, varlen=[0, 0, 9])), layouts=False, every_argument=False, **common))
    return cases


# ------------------------------------------------------------------------------------ causal conv1d


def _conv_build(B=2, D=5, T=7, W=4, x_dtype=F32, w_dtype=None, init_dtype=None, seq=True, init=True):
    w_dtype = w_dtype or x_dtype
    a = dict(x=torch.randn(B, D, T, dtype=x_dtype), weight=(torch.randn(D, W) / W).to(w_dtype),
             bias=torch.randn(D).to(w_dtype), activation="silu", return_final_states=True)
    if seq:  # packed sequences, and a padded time in the first row
        a["seq_idx"] = torch.tensor([[0, 0, 0, 1, 1, 1, -1], [0, 1, 1, 1, 1, 2, 2]], dtype=torch.int32)[:B, :T]
    if init:
        a["initial_states"] = torch.randn(B, D, W - 1).to(init_dtype or x_dtype)
    return a


def _conv_update_build(B=2, D=5, L=3, W=4, S=5, x_dtype=F32, state_dtype=None, w_dtype=None, pool=False,
                       circular=False, x2d=False):
    w_dtype = w_dtype or x_dtype
    N = B + 1 if pool else B
    a = dict(x=(torch.randn(B, D) if x2d else torch.randn(B, D, L)).to(x_dtype),
             conv_state=torch.randn(N, D, S).to(state_dtype or x_dtype), weight=(torch.randn(D, W) / W).to(w_dtype),
             bias=torch.randn(D).to(w_dtype), activation="silu")
    if circular:
        a["cache_seqlens"] = torch.tensor([4, 2, 7][:B])
    if pool:  # no index equals the integer poison 0, where a read past the view would land
        a["conv_state_indices"] = torch.tensor([2, 1, 3][:B])
    return a


def _conv_cases():
    c = dict(call=dk.causal_conv1d, grads=("x", "weight", "bias", "initial_states"), ref=ref.naive_causal_conv1d,
             out_dtypes=_dtypes_like("x", "x"))
    # The backward's cost is per batch row (one 256-step chunk at least): the arguments with a batch dim
    # are laid out at B = 2, the weights at B = 1.
    # Every argument at once: in the mixed-dtype case, at B = 1.
    cases = [Case("conv1d", "conv1d", _seeded(_conv_build), layout_args=("x", "seq_idx", "initial_states"),
                  every_argument=False, **c),
             Case("conv1d-weights", "conv1d", _seeded(functools.partial(_conv_build, B=1, seq=False)),
                  layout_args=("weight", "bias"), every_argument=False, **c),
             Case("conv1d[bf16-x,fp32-weight]", "conv1d", _seeded(functools.partial(
                 _conv_build, B=1, x_dtype=BF16, w_dtype=F32, init_dtype=F32)), layouts=False, **c),
             Case("conv1d[bf16]", "conv1d", _seeded(functools.partial(_conv_build, B=1, x_dtype=BF16)),
                  layouts=False, every_argument=False, **c),
             Case("conv1d[fp16-x,fp32-weight]", "conv1d", _seeded(functools.partial(
                 _conv_build, B=1, x_dtype=F16, w_dtype=F32)), layouts=False, every_argument=False, **c),
             Case("conv1d[B=0]", "conv1d", _seeded(functools.partial(_conv_build, B=0, seq=False)), layouts=False,
                  **c)]
    # The state is updated in place: an expanded one is refused (its elements would share memory). The
    # pool's indices must stay distinct: not expanded.
    refuses = tuple(("conv_state", lo, ValueError, "conv_state: updated in place")
                    for lo in ("expanded", "expanded-last"))
    up = dict(call=_single(dk.causal_conv1d_update), ref=_single(ref.naive_causal_conv1d_update),
              out_dtypes=_dtypes_like("x"), inplace=("conv_state",), refuses=refuses,
              skip=(("conv_state_indices", "expanded"),))
    for name, kw in (("", {}), ("-x2d", dict(x2d=True)), ("-circular-pool", dict(circular=True, pool=True))):
        cases.append(Case(f"conv1d-update{name}", "conv1d", _seeded(functools.partial(_conv_update_build, **kw)),
                          **up))
    for name, kw in (("bf16-x,fp32-state,fp32-weight", dict(x_dtype=BF16, state_dtype=F32, w_dtype=F32)),
                     ("bf16", dict(x_dtype=BF16, circular=True, pool=True)),
                     ("B=0", dict(B=0)), ("L=0", dict(L=0))):
        cases.append(Case(f"conv1d-update[{name}]", "conv1d", _seeded(functools.partial(_conv_update_build, **kw)),
                          layouts=False, **up))
    return cases


# ----------------------------------------------------------------------------- linear cross-entropy


def _lce_build(dtype=F32, weights_dtype=F32, labels_dtype=torch.int64, reduction="mean", softcap=None, N=6):
    """``_lce``'s hidden, weight, labels (test_malformed.py) as a ``[2, N / 2, H]`` batch, with a bias,
    per-row weights and an ignored row."""
    a = _lce(N=N, H=16, V=11)
    a["hidden"] = a["hidden"].view(2, N // 2, 16).to(dtype)
    a["weight"] = (a["weight"] / 4).to(dtype)
    labels = a["labels"].view(2, N // 2).to(labels_dtype)
    if N:
        labels[1, 0] = -100
    a.update(labels=labels, bias=torch.randn(11).to(dtype), weights=torch.rand(2, N // 2).to(weights_dtype),
             reduction=reduction, softcap=softcap, return_lse=True, return_argmax=True)
    return a


def _lce_cases():
    # An expanded weight repeats one vocabulary row: every logit of a row is then the same up to the bias, the
    # hidden gradient is exactly 0 up to rounding (sum_v (p_v - y_v) w_v with w_v equal), so the comparison would
    # be of two rounding residuals, which depend on the CPU's summation order (they differed on an AVX2 machine).
    c = dict(call=dk.linear_cross_entropy, grads=("hidden", "weight", "bias"), ref=ref.naive_linear_cross_entropy,
             out_dtypes=_dtypes_like(F32, F32, torch.int64), skip=(("weight", "expanded"),))
    b = _lce_build
    return [Case("lce-mean", "linear_cross_entropy", _seeded(b), **c),
            Case("lce-none-softcap", "linear_cross_entropy",
                 _seeded(functools.partial(b, reduction="none", softcap=5.0)), **c),
            Case("lce[bf16,fp64-weights,int32-labels]", "linear_cross_entropy", _seeded(functools.partial(
                b, dtype=BF16, weights_dtype=torch.float64, labels_dtype=torch.int32)), layouts=False, **c),
            Case("lce-none[fp16,bf16-weights]", "linear_cross_entropy", _seeded(functools.partial(
                b, dtype=F16, weights_dtype=BF16, reduction="none")), layouts=False, **c),
            Case("lce[N=0]", "linear_cross_entropy", _seeded(functools.partial(b, N=0)), layouts=False, **c),
            Case("lce-none[N=0]", "linear_cross_entropy", _seeded(functools.partial(b, N=0, reduction="none")),
                 layouts=False, **c)]


# ------------------------------------------------------------------------------------------ RMSNorm


def _norm_build(second=None, shape=(2, 3, 13), x_dtype=F32, w_dtype=None, second_dtype=None, offset=0.0):
    """x, the op's second activation (``gate`` or ``residual``; the residual in x's dtype), weight."""
    a = dict(x=torch.randn(shape, dtype=x_dtype))
    if second is not None:
        a[second] = torch.randn(shape).to(x_dtype if second == "residual" else second_dtype or x_dtype)
    a.update(weight=(1 + 0.5 * torch.randn(shape[-1])).to(w_dtype or x_dtype), offset=offset)
    return a


def _norm_cases():
    cases = []
    for name, second, call, reference, out in (
            ("rms_norm", None, _single(dk.rms_norm), _single(ref.naive_rms_norm), _dtypes_like("x")),
            ("rms_norm_gated", "gate", _single(dk.rms_norm_gated), _single(ref.naive_rms_norm_gated),
             _dtypes_like("x")),
            ("fused_add_rms_norm", "residual", dk.fused_add_rms_norm, ref.naive_fused_add_rms_norm,
             _dtypes_like("x", "x"))):
        c = dict(call=call, grads=("x", second, "weight") if second else ("x", "weight"), ref=reference,
                 out_dtypes=out)
        b = functools.partial(_norm_build, second)
        cases += [Case(name, "rms_norm", _seeded(b), **c),
                  Case(f"{name}[offset=1]", "rms_norm", _seeded(functools.partial(b, offset=1.0)), layouts=False, **c),
                  Case(f"{name}[bf16-x,fp32-weight]", "rms_norm", _seeded(functools.partial(
                      b, x_dtype=BF16, w_dtype=F32, second_dtype=F32)), layouts=False, **c),
                  Case(f"{name}[fp16-x,bf16-weight]", "rms_norm", _seeded(functools.partial(
                      b, x_dtype=F16, w_dtype=BF16, second_dtype=BF16)), layouts=False, **c),
                  Case(f"{name}[rows=0]", "rms_norm", _seeded(functools.partial(b, shape=(0, 13))), layouts=False,
                       **c),
                  Case(f"{name}[T=0]", "rms_norm", _seeded(functools.partial(b, shape=(2, 0, 13))), layouts=False,
                       **c)]
    return cases


# --------------------------------------------------------------------------------------------- RoPE


def _rope_build(B=2, T=3, H=2, D=8, R=6, x_dtype=F32, cos_dtype=F32, cos_batch=None, cos4d=False):
    """x and the cos / sin of positions ``t + offset`` (one offset per batch row), partial rotary R < D."""
    pos = torch.arange(T, dtype=torch.float64)[:, None] + torch.randn(cos_batch or max(B, 1), 1, 1).double()
    angle = pos * 0.7 ** torch.arange(R // 2, dtype=torch.float64)
    angle = torch.cat([angle, angle], -1)
    cos, sin = angle.cos().to(cos_dtype), angle.sin().to(cos_dtype)
    if cos4d:
        cos, sin = cos[:, :, None], sin[:, :, None]
    return dict(x=torch.randn(B, T, H, D, dtype=x_dtype), cos=cos, sin=sin)


def _rope_cases():
    c = dict(call=_single(dk.apply_rope), grads=("x",), ref=_single(ref.naive_apply_rope),
             out_dtypes=_dtypes_like("x"))
    b = _rope_build
    return [Case("rope", "rope", _seeded(b), **c),
            Case("rope-cos4d-batch1", "rope", _seeded(functools.partial(b, cos4d=True, cos_batch=1)), **c),
            Case("rope[bf16-x,fp32-cos]", "rope", _seeded(functools.partial(b, x_dtype=BF16)), layouts=False, **c),
            Case("rope[fp16-x,bf16-cos]", "rope", _seeded(functools.partial(b, x_dtype=F16, cos_dtype=BF16)),
                 layouts=False, **c),
            Case("rope[bf16]", "rope", _seeded(functools.partial(b, x_dtype=BF16, cos_dtype=BF16, R=8)),
                 layouts=False, **c),
            Case("rope[T=0]", "rope", _seeded(functools.partial(b, T=0)), layouts=False, **c),
            Case("rope[B=0]", "rope", _seeded(functools.partial(b, B=0, cos_batch=1)), layouts=False, **c),
            Case("rope[H=0]", "rope", _seeded(functools.partial(b, H=0)), layouts=False, **c)]


# ------------------------------------------------------------------------------------------- SwiGLU


def _swiglu_build(shape, dtype):
    return dict(gate=torch.randn(shape, dtype=dtype), up=torch.randn(shape, dtype=dtype))


def _swiglu_packed_build(shape, dtype):
    return dict(x=torch.randn(shape, dtype=dtype))


def _swiglu_cases():
    two = dict(call=_single(dk.swiglu), grads=("gate", "up"), ref=_single(ref.naive_swiglu),
               out_dtypes=_dtypes_like("gate"))
    one = dict(call=_single(dk.swiglu_packed), grads=("x",), ref=_single(ref.naive_swiglu_packed),
               out_dtypes=_dtypes_like("x"))
    cases = []
    for name, build, c, C in (("swiglu", _swiglu_build, two, 7), ("swiglu_packed", _swiglu_packed_build, one, 14)):
        cases += [Case(name, "swiglu", _seeded(functools.partial(build, (3, 2, C), F32)), **c),
                  Case(f"{name}[bf16]", "swiglu", _seeded(functools.partial(build, (3, 2, C), BF16)), layouts=False,
                       **c),
                  Case(f"{name}[fp16]", "swiglu", _seeded(functools.partial(build, (3, 2, C), F16)), layouts=False,
                       **c),
                  Case(f"{name}[rows=0]", "swiglu", _seeded(functools.partial(build, (0, C), F32)), layouts=False,
                       **c),
                  Case(f"{name}[C=0]", "swiglu", _seeded(functools.partial(build, (3, 0), F32)), layouts=False, **c)]
    return cases


CASES = _attention_cases() + _gdn_cases() + _conv_cases() + _lce_cases() + _norm_cases() + _rope_cases() + \
    _swiglu_cases()
CASE_BY_ID = {c.id: c for c in CASES}
assert len(CASE_BY_ID) == len(CASES), "case ids must be unique"


# ---------------------------------------------------------------------------------------------------
# running a case


@dataclasses.dataclass
class Run:
    args: dict  # the arguments as passed (views)
    outs: tuple
    grads: dict  # argument name -> gradient
    differentiable: list  # indices of the outputs given an upstream gradient


def _grad_outputs(outs):
    """Fixed upstream gradients, one per differentiable output."""
    gen = torch.Generator().manual_seed(SEED + 1)
    return [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]


def _call(case: Case, args: dict, differentiable=None) -> Run:
    """Call ``case`` and take the gradients of its leaves (``case.grads``) under fixed upstream gradients
    of the outputs that require grad, or of those of ``differentiable`` (output indices: a reference
    differentiates what the kernels mark non-differentiable)."""
    outs = case.call(**args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    leaves = [n for n in case.grads if isinstance(args.get(n), torch.Tensor)]
    if differentiable is None:
        differentiable = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
        reference = False
    else:  # a reference: its empty outputs may hang off no graph (the GDN's state of an empty batch)
        reference = True
    grads = {}
    if leaves:
        assert differentiable, f"{case.id}: no output requires grad"
        diff = [outs[i] for i in differentiable if outs[i].requires_grad or not reference]
        got = torch.autograd.grad(diff, [args[n] for n in leaves], _grad_outputs(diff), allow_unused=reference,
                                  materialize_grads=reference)
        grads = dict(zip(leaves, got))
    return Run(args, outs, grads, differentiable)


def _with_leaves(case: Case, args: dict) -> dict:
    for n in case.grads:
        if isinstance(args.get(n), torch.Tensor):
            args[n].requires_grad_(True)
    return args


def _contiguous_clones(args: dict) -> dict:
    return {n: v.detach().clone(memory_format=torch.contiguous_format) if isinstance(v, torch.Tensor) else v
            for n, v in args.items()}


_EXPECTED = {}  # case id -> the Run of its contiguous call (layouts keeping the values all compare to it)


def _expected(case: Case, args: dict, layouts: dict) -> Run:
    """The op called with contiguous clones of ``args``; the same for every layout that keeps the
    contiguous values, so that run is made once per case (the interpreter is slow)."""
    if any(lo not in SAME_VALUES for lo in layouts.values()):
        return _call(case, _with_leaves(case, _contiguous_clones(args)))
    if case.id not in _EXPECTED:
        _EXPECTED[case.id] = _call(case, _with_leaves(case, _contiguous_clones(case.build())))
    return _EXPECTED[case.id]


def _refused(case: Case, layouts: dict):
    return next(((n, r) for n, lo in layouts.items() if (r := case.refusal(n, lo)) is not None), None)


def check_layouts(case: Case, layouts: dict) -> None:
    """Call ``case`` with the arguments of ``layouts`` laid out so (the others contiguous), and its
    contiguous clones; the two must agree (see the module docstring), or the op refuses."""
    require_triton_kernels(case.op)
    args = case.build()
    bases = {}
    for n, layout in layouts.items():
        args[n], bases[n] = lay_out(args[n], layout, case.swap_of(n))
    refused = _refused(case, layouts)
    if refused is not None:
        before = {n: t.clone() for n, t in bases.items()}
        with pytest.raises(refused[1][0], match=refused[1][1]):
            case.call(**args)
        for n, t in bases.items():
            torch.testing.assert_close(t, before[n], rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m, n=n: f"{n} written by a refused call: {m}")
        return
    memory = {n: bases.get(n, v) for n, v in args.items() if isinstance(v, torch.Tensor)}
    before = {n: t.detach().clone() for n, t in memory.items()}
    exp = _expected(case, args, layouts)
    got = _call(case, _with_leaves(case, args))

    assert len(got.outs) == len(exp.outs)
    for i, (o, e) in enumerate(zip(got.outs, exp.outs)):
        assert (o is None) == (e is None), f"output {i}"
        if o is not None:
            assert_same(f"output {i}", o, e)
    for n, g in got.grads.items():
        assert g is not None, f"gradient of {n}: None"
        assert_same(f"gradient of {n}", g, exp.grads[n])
    for n, t in memory.items():
        if n in case.inplace:
            assert_same(f"{n} (updated in place)", got.args[n], exp.args[n])
            outside = ~_covered(got.args[n], t)
            torch.testing.assert_close(t[outside], before[n][outside], rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m, n=n: f"{n}: elements outside the view written: {m}")
        else:
            torch.testing.assert_close(t.detach(), before[n], rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m, n=n: f"{n} (only read) was written: {m}")
    results = {f"output {i}": o for i, o in enumerate(got.outs) if isinstance(o, torch.Tensor)}
    results.update({f"gradient of {n}": g for n, g in got.grads.items()})
    assert_no_alias(results, {n: t for n, t in memory.items() if n not in case.inplace})


def _layout_params():
    """Each (case, argument, layout). The default run takes one layout per argument, the layouts in turn
    over the arguments of all cases; -m slow the others."""
    params = []
    turn = 0
    for case in CASES:
        if not case.layouts:
            continue
        for name in case.tensor_args():
            if case.layout_args is not None and name not in case.layout_args:
                continue
            t = case.build()[name]
            laid = [lo for lo in case.layout_set if (name, lo) not in case.skip and applies(t, lo, case.swap_of(name))]
            for i, layout in enumerate(laid):
                params.append(slow_param(case.id, name, layout, id=f"{case.id}-{name}-{layout}",
                                         slow=i != turn % len(laid)))
            turn += 1
    return params


@pytest.mark.parametrize("case_id,arg,layout", _layout_params())
def test_layout(case_id, arg, layout):
    """One argument laid out, the others contiguous (fp32 cases)."""
    check_layouts(CASE_BY_ID[case_id], {arg: layout})


def _every_argument_params():
    """Each (case, layout). The default run takes one layout per case, the layouts in turn over the cases;
    -m slow the others."""
    params = []
    turn = 0
    for case in CASES:
        if not case.every_argument:
            continue
        args = case.build()
        laid = [lo for lo in LAYOUTS if any((n, lo) not in case.skip and case.refusal(n, lo) is None
                                            and applies(args[n], lo, case.swap_of(n)) for n in case.tensor_args())]
        for i, layout in enumerate(laid):
            params.append(slow_param(case.id, layout, id=f"{case.id}-{layout}", slow=i != turn % len(laid)))
        turn += 1
    return params


@pytest.mark.parametrize("case_id,layout", _every_argument_params())
def test_every_argument_laid_out(case_id, layout):
    """Every argument that takes the layout laid out so at once (fp32 cases and every dtype mix)."""
    case = CASE_BY_ID[case_id]
    args = case.build()
    check_layouts(case, {n: layout for n in case.tensor_args() if (n, layout) not in case.skip
                         and case.refusal(n, layout) is None and applies(args[n], layout, case.swap_of(n))})


@pytest.mark.parametrize("case_id", [c.id for c in CASES if c.ref is not None])
def test_against_reference(case_id):
    """The contiguous call against the fp32 reference: every output and gradient, in its documented
    dtype (a gradient in its argument's), and no output or gradient sharing memory."""
    case = CASE_BY_ID[case_id]
    require_triton_kernels(case.op)
    args = case.build()
    low = _float_dtypes(args) - {F32, torch.float64}
    tol, row_tol = case.low_tol if low else case.ref_tol
    got = _call(case, _with_leaves(case, _contiguous_clones(args)))
    fp32 = {n: v.detach().float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for n, v in args.items()}
    exp = _call(dataclasses.replace(case, call=case.ref), _with_leaves(case, fp32), got.differentiable)
    if case.out_dtypes is not None:
        want = case.out_dtypes(args)
        assert tuple(o.dtype for o in got.outs) == want, f"output dtypes {[o.dtype for o in got.outs]} != {want}"
    for i, (o, e) in enumerate(zip(got.outs, exp.outs)):
        if not o.is_floating_point():
            if not low:  # an argmax of rounded logits may pick another of nearly tied entries
                assert torch.equal(o, e), f"output {i}"
            continue
        _close_to_reference(f"output {i}", o, e, tol, row_tol)
    for n in case.inplace:
        _close_to_reference(f"{n} (updated in place)", got.args[n], exp.args[n], tol, row_tol)
    for n, g in got.grads.items():
        assert g.dtype == args[n].dtype, f"gradient of {n}: dtype {g.dtype} != the argument's {args[n].dtype}"
        _close_to_reference(f"gradient of {n}", g, exp.grads[n], tol, row_tol)
    results = {f"output {i}": o for i, o in enumerate(got.outs)}
    results.update({f"gradient of {n}": g for n, g in got.grads.items()})
    assert_no_alias(results, {n: v for n, v in got.args.items() if isinstance(v, torch.Tensor)
                              and n not in case.inplace})


# ---------------------------------------------------------------------------------------------------
# refused dtype mixes and sizes


def _refusal(case_id, change, exc, match):
    return pytest.param(case_id, change, exc, match, id=f"{case_id}-{match.split(':')[0]}-{change.__name__}")


def _k_fp16(a):
    return {**a, "k": a["k"].half(), "v": a["v"].half()}


def _up_bf16(a):
    return {**a, "up": a["up"].bfloat16()}


def _weight_bf16(a):
    return {**a, "weight": a["weight"].bfloat16()}


def _bias_bf16(a):
    return {**a, "bias": a["bias"].bfloat16()}


def _residual_bf16(a):
    return {**a, "residual": a["residual"].bfloat16()}


def _sin_bf16(a):
    return {**a, "sin": a["sin"].bfloat16()}


def _time_0(a):
    return {**a, "x": a["x"][..., :0], "seq_idx": a["seq_idx"][:, :0]}


def _tokens_0(a):
    return {n: v[:, :0] if n in ("q", "k", "v", "g", "beta") else v for n, v in a.items()}


def _labels_float(a):
    return {**a, "labels": a["labels"].float()}


REFUSED = [
    _refusal("attention-dflash", _k_fp16, TypeError, "k, v: dtypes"),
    _refusal("swiglu", _up_bf16, TypeError, "up: dtype"),
    _refusal("lce-mean", _weight_bf16, TypeError, "weight: dtype"),
    _refusal("lce-mean", _bias_bf16, TypeError, "bias: dtype"),
    _refusal("lce-mean", _labels_float, TypeError, "labels: dtype"),
    _refusal("fused_add_rms_norm", _residual_bf16, ValueError, "residual: expected x's dtype"),
    _refusal("rope", _sin_bf16, TypeError, "sin: dtype"),
    _refusal("conv1d", _time_0, ValueError, "x: the time dimension is empty"),
    _refusal("gdn-chunk", _tokens_0, ValueError, "q: T must be at least 1"),
    _refusal("gdn-recurrent", _tokens_0, ValueError, "q: T must be at least 1"),
]


@pytest.mark.parametrize("case_id,change,exc,match", REFUSED)
def test_refused(case_id, change, exc, match):
    case = CASE_BY_ID[case_id]
    with pytest.raises(exc, match=re.escape(match)):
        case.call(**change(case.build()))


# ---------------------------------------------------------------------------------------------------
# fused_adamw_: in place over lists; tensors must be contiguous (a storage offset is fine)


ADAMW_LISTS = ("params", "grads", "exp_avgs", "exp_avg_sqs", "compute_copies")
ADAMW_HP = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)


def _adamw_build(grad_dtype=F32, copy_dtype=BF16, device_hparams=False):
    torch.manual_seed(SEED)
    shapes = [(5, 3), (7,), (0,), (2, 1, 3)]
    a = dict(params=[torch.randn(s) for s in shapes], grads=[torch.randn(s).to(grad_dtype) for s in shapes],
             exp_avgs=[torch.randn(s) * 0.1 for s in shapes], exp_avg_sqs=[torch.rand(s) * 0.1 for s in shapes],
             compute_copies=[torch.empty(s, dtype=copy_dtype) for s in shapes[:2]] + [None, None],
             grad_scale=torch.tensor([2.0]))
    a["step"] = [torch.tensor([s]) for s in (3.0, 1.0, 2.0, 5.0)] if device_hparams else 3
    if device_hparams:
        a["lr"] = torch.tensor([ADAMW_HP["lr"]])
    return a


def _adamw_step(fn, a):
    hp = {**ADAMW_HP, **({"lr": a["lr"]} if "lr" in a else {})}
    fn(a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], step=a["step"], grad_scale=a["grad_scale"],
       compute_copies=a["compute_copies"], **hp)


def _adamw_clones(a):
    c = {}
    for n, v in a.items():
        if isinstance(v, list):
            c[n] = [None if t is None else t.clone(memory_format=torch.contiguous_format) for t in v]
        else:
            c[n] = v.clone() if isinstance(v, torch.Tensor) else v
    return c


def _adamw_compare(got, ref_args, updated=("params", "exp_avgs", "exp_avg_sqs", "compute_copies")):
    for n in updated:
        for i, (t, e) in enumerate(zip(got[n], ref_args[n])):
            if t is not None:
                assert_same(f"{n}[{i}]", t, e)


def _adamw_params():
    params = []
    for name in ADAMW_LISTS:
        for layout in LAYOUTS:
            params.append(pytest.param(name, layout, id=f"adamw-{name}[0]-{layout}"))
    return params


@pytest.mark.parametrize("name,layout", _adamw_params())
def test_adamw_layout(name, layout):
    """Entry 0 of one list laid out: a contiguous view at an offset is updated in place like the
    reference step (the elements around it untouched); any other layout is refused naming the entry."""
    require_triton_kernels("adamw")
    a = _adamw_build()
    view, base = lay_out(a[name][0], layout)
    a[name][0] = view
    before = base.clone()
    expected = _adamw_clones(a)
    kernels = _adamw_clones(a)
    if not view.is_contiguous():
        with pytest.raises(ValueError, match=re.escape(f"{name}[0]: ") + "(must be contiguous|expected a contiguous)"):
            _adamw_step(dk.fused_adamw_, a)
        torch.testing.assert_close(base, before, rtol=0, atol=0, equal_nan=True)  # nothing written
        return
    _adamw_step(dk.fused_adamw_, a)
    naive_adamw_(expected["params"], expected["grads"], expected["exp_avgs"], expected["exp_avg_sqs"],
                 step=expected["step"], grad_scale=expected["grad_scale"], compute_copies=expected["compute_copies"],
                 **ADAMW_HP)
    _adamw_step(dk.fused_adamw_, kernels)
    _adamw_compare(a, kernels)
    _adamw_compare(a, expected)
    outside = ~_covered(view, base)
    torch.testing.assert_close(base[outside], before[outside], rtol=0, atol=0, equal_nan=True)
    if name == "grads":
        torch.testing.assert_close(base, before, rtol=0, atol=0, equal_nan=True)  # only read


@pytest.mark.parametrize("name,layout", [(n, lo) for n in ("grad_scale", "lr", "step")
                                         for lo in ("offset", "expanded")], ids=lambda v: v)
def test_adamw_device_scalars_laid_out(name, layout):
    """grad_scale, a device lr and per-parameter device steps: one element each, at an offset or as a
    stride-0 view of a scalar."""
    require_triton_kernels("adamw")
    a = _adamw_build(device_hparams=True)

    def put(t):
        if layout == "expanded":
            return t.reshape(()).expand(t.shape)
        return lay_out(t, "offset")[0]

    a[name] = [put(t) for t in a[name]] if isinstance(a[name], list) else put(a[name])
    expected = _adamw_clones(a)
    _adamw_step(dk.fused_adamw_, a)
    naive_adamw_(expected["params"], expected["grads"], expected["exp_avgs"], expected["exp_avg_sqs"],
                 step=expected["step"], grad_scale=expected["grad_scale"], compute_copies=expected["compute_copies"],
                 lr=float(expected["lr"]), **{k: v for k, v in ADAMW_HP.items() if k != "lr"})
    _adamw_compare(a, expected, updated=("params", "exp_avgs", "exp_avg_sqs"))


@pytest.mark.parametrize("grad_dtype,copy_dtype,device_hparams", [
    (BF16, BF16, False), (F16, F16, False), (F32, F32, True), (BF16, F16, True)],
    ids=["bf16-grads,bf16-copies", "fp16-grads,fp16-copies", "fp32,device-hparams", "bf16-grads,fp16-copies,device"])
def test_adamw_dtype_mix(grad_dtype, copy_dtype, device_hparams):
    """Gradients and compute copies in a low precision against the fp32 reference step (the copies
    rounded from the updated parameters); grads are only read."""
    require_triton_kernels("adamw")
    a = _adamw_build(grad_dtype, copy_dtype, device_hparams)
    expected = _adamw_clones(a)
    grads_before = [g.clone() for g in a["grads"]]
    _adamw_step(dk.fused_adamw_, a)
    hp = {**ADAMW_HP, "lr": float(expected.get("lr", ADAMW_HP["lr"]))}
    naive_adamw_(expected["params"], expected["grads"], expected["exp_avgs"], expected["exp_avg_sqs"],
                 step=expected["step"], grad_scale=expected["grad_scale"], compute_copies=expected["compute_copies"],
                 **hp)
    _adamw_compare(a, expected)
    for g, b in zip(a["grads"], grads_before):
        assert torch.equal(g, b)
