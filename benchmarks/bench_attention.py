"""Block-sparse attention on the DFlash training mask: dflash_kernels against torch.compile(flex_attention),
dense causal SDPA, FlashAttention-4 and flex's FLASH backend, each implementation in a process of its own
(``--child NAME`` prints its rows; the parent collects them, so one implementation's compile caches, allocator
state or CUDA fault never touch another's timings).

Effective FLOPs count only visible (query, key) pairs: a forward is two matmuls (QK^T and PV) of
2 * D flops per pair and head, so ``4 * D * Hq * pairs``; a backward is 2.5x that (five matmuls,
the recomputed QK^T included), so fwd+bwd = ``3.5 * 4 * D * Hq * pairs``. GPU times are
``triton.testing.do_bench`` medians; peak memory is the largest allocation above the inputs during
one call. The mask build is timed on its own (``mask_ms``; flex's ``create_block_mask`` is timed once,
uncompiled, as trainers rebuild it every step). Called by ``benchmarks/ops.py attention``.

The implementations (``--impls``), on CUDA (on a CPU only ours runs, at a tiny shape, to check the job runs):

- ``dflash_kernels``: ``block_sparse_attention`` with ``dflash_block_mask`` at every shape, then under
  ``causal_block_mask`` on the dense causal shape (its dense case).
- ``flex``: ``torch.compile(flex_attention)`` (Triton) with a ``create_block_mask`` mask of 128 x 128 blocks.
- ``sdpa``: dense causal ``scaled_dot_product_attention`` through each fused backend torch offers: the
  chip's attention ceiling, with the same effective-FLOP count.

- ``fa4``: FlashAttention-4 (``flash_attn.cute.flash_attn_func``, flash-attn-4 4.0.0b36) with FA4's
  block-sparse tensors (from ``create_block_mask`` at 128 x 128 blocks, the size FA4's Hopper
  backward takes; the forward's kv-direction lists, the backward's q-direction lists) plus a CuteDSL
  ``mask_mod`` of the DFlash mask reading the anchors from an aux tensor.
- ``flex_flash``: ``torch.compile(flex_attention)`` with ``kernel_options={"BACKEND": "FLASH"}``
  (inductor generates a CuteDSL mask_mod and calls FA4); torch 2.11's CuteDSL op overrides lack
  ``minimum``, ``maximum`` and ``index_expr``, added by :func:`patch_torch_cutedsl_ops` first.

Both check their output and gradients against ``block_sparse_attention`` (relative Frobenius error)
before any timing, and report one ``skipped`` row per shape, not a crash, when FA4 is not installed:
it is not on the GPU machine's image; ``tools/gpu/peer_kit.sh`` carries and installs it. Run alone:
``python benchmarks/bench_attention.py [--quick] [--impls fa4,flex_flash]``.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # dflash_kernels, run as a script
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import bench_ms, peak_mib, run_rows  # noqa: E402

SHAPES = [
    dict(B=4, S=3072, N=512, Hq=32, Hkv=8, D=128, window=None),
    dict(B=1, S=3072, N=512, Hq=32, Hkv=8, D=128, window=None),
    dict(B=4, S=3072, N=512, Hq=32, Hkv=8, D=128, window=2048),
    dict(B=1, S=3072, N=512, Hq=32, Hkv=8, D=128, window=2048),
    dict(B=4, S=4096, N=512, Hq=32, Hkv=8, D=128, window=None),
]
CPU_SHAPE = dict(B=1, S=45, N=3, Hq=4, Hkv=1, D=64, window=None)  # checks the job runs; says nothing of speed
BLOCK = 16  # DFlash draft block size


def _shape_name(s):
    w = "" if s["window"] is None else f",W={s['window']}"
    return f"B={s['B']},S={s['S']},N={s['N']},Hq={s['Hq']},Hkv={s['Hkv']},D={s['D']}{w}"


def _flex_mask_mod(anchors, S, window):
    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // BLOCK
        a = anchors[b, blk]
        ctx = (kv_idx < a) if window is None else (kv_idx < a) & (kv_idx >= a - window)
        own = (kv_idx >= S) & ((kv_idx - S) // BLOCK == blk)
        return ctx | own
    return mask_mod


def _measure(row, fwd, fwd_bwd, flops, quick, device):
    row["fwd_ms"] = bench_ms(fwd, quick, device.type == "cuda")
    row["fwd_TFLOPs_eff"] = flops / row["fwd_ms"] * 1e-9
    row["fwdbwd_ms"] = bench_ms(fwd_bwd, quick, device.type == "cuda")
    row["fwdbwd_TFLOPs_eff"] = 3.5 * flops / row["fwdbwd_ms"] * 1e-9
    row["peak_MiB_fwdbwd"] = peak_mib(fwd_bwd, device.type == "cuda")


def _shape_inputs(s, device, dtype):
    """Anchors, q, k, v (with gradients), do, the DFlash mask and its visible pairs at shape ``s``: the same
    for ours and every peer."""
    from dflash_kernels.ops.attention import dflash_block_mask

    B, S, N, Hq, Hkv, D, W = s["B"], s["S"], s["N"], s["Hq"], s["Hkv"], s["D"], s["window"]
    Tq, Tk = N * BLOCK, S + N * BLOCK
    g = torch.Generator().manual_seed(0)
    # Sorted, as a trainer samples anchor positions along a sequence. (Our kernels do the same work
    # either way; flex's 128-row tiles mix blocks of distant anchors when they are unsorted.)
    anchors = torch.sort(torch.randint(0, S, (B, N), generator=g), dim=1).values.to(device)
    torch.manual_seed(0)
    q = torch.randn(B, Tq, Hq, D, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Tk, Hkv, D, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Tk, Hkv, D, device=device, dtype=dtype, requires_grad=True)
    do = torch.randn(B, Tq, Hq, D, device=device, dtype=dtype)
    mask = dflash_block_mask(anchors, S, BLOCK, window=W)
    return anchors, q, k, v, do, mask, int(mask.visible_pairs().sum())


def _ours_label(q, k, v, mask) -> dict:
    """Our rows' ``impl`` ("dflash_kernels", with the backend when one is set: ``DFLASH_KERNELS_BACKEND=
    attention=portable`` times the portable kernels on a GPU where the default runs a Hopper forward) and the
    forward kernel that runs (``forward_path``)."""
    from dflash_kernels import get_backend
    from dflash_kernels.ops.attention.attention import _attention, forward_path

    backend = get_backend("attention")
    impl = "dflash_kernels" if backend == "auto" else f"dflash_kernels (backend {backend})"
    resolved = _attention.backend(q.device)
    path = forward_path(q, k, v, mask, resolved) if resolved in ("triton", "portable", "interpret") else resolved
    return {"impl": impl, "forward": path}


def _bench_ours(s, device, dtype, quick) -> dict:
    """Our row at shape ``s``: the mask build, forward and forward + backward (tuned and compiled first)."""
    from dflash_kernels.ops.attention import block_sparse_attention, dflash_block_mask

    S, Hq, D, W = s["S"], s["Hq"], s["D"], s["window"]
    anchors, q, k, v, do, mask, pairs = _shape_inputs(s, device, dtype)
    flops = 4 * D * Hq * pairs
    base = {"op": "attention", "shape": _shape_name(s), "dtype": str(dtype), "visible_pairs": pairs}

    ours = {**base, **_ours_label(q, k, v, mask)}
    ours["mask_ms"] = bench_ms(lambda: dflash_block_mask(anchors, S, BLOCK, window=W), quick,
                               device.type == "cuda")

    def fwd():
        with torch.no_grad():
            block_sparse_attention(q, k, v, mask)

    def fwd_bwd():
        torch.autograd.grad(block_sparse_attention(q, k, v, mask), (q, k, v), do)

    try:
        fwd_bwd()  # compile (and tune) outside the timings
        _measure(ours, fwd, fwd_bwd, flops, quick, device)
    except Exception as e:  # noqa: BLE001 - report, keep the run going
        ours["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return ours


def _compiled_flex():
    """``torch.compile(flex_attention)`` for one shape, with dynamo's caches reset first and static shapes. Each
    shape compiles a forward and a forward + backward entry for flex_attention's code; compiled anew per shape in
    one process without a reset, the fifth shape passed dynamo's recompile limit (8) and ran flex_attention
    eagerly, which builds the dense fp32 scores [B, H, Tq, Tk]: "Tried to allocate 48.00 GiB" at B=4, S=4096
    (benchmarks/results/README.md, the same-run comparison with FA4)."""
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    return torch.compile(flex_attention, dynamic=False)


def _bench_flex(s, device, dtype, quick) -> dict:
    """``torch.compile(flex_attention)``'s row at shape ``s`` (the inputs ours takes): ``create_block_mask``
    once, uncompiled, then forward and forward + backward."""
    B, S, N, Hq, D, W = s["B"], s["S"], s["N"], s["Hq"], s["D"], s["window"]
    Tq, Tk = N * BLOCK, S + N * BLOCK
    anchors, q, k, v, do, _mask, pairs = _shape_inputs(s, device, dtype)
    flops = 4 * D * Hq * pairs
    flex_row = {"op": "attention", "shape": _shape_name(s), "dtype": str(dtype), "visible_pairs": pairs,
                "impl": "flex (torch.compile)"}
    try:
        from torch.nn.attention.flex_attention import create_block_mask
        flex = _compiled_flex()
        t0 = time.perf_counter()
        block_mask = create_block_mask(_flex_mask_mod(anchors, S, W), B, None, Tq, Tk, device=device,
                                       BLOCK_SIZE=128)
        torch.cuda.synchronize()
        flex_row["mask_ms"] = (time.perf_counter() - t0) * 1e3
        qt, kt, vt, dot = (x.transpose(1, 2) for x in (q, k, v, do))

        def flex_fwd():
            with torch.no_grad():
                flex(qt, kt, vt, block_mask=block_mask, enable_gqa=True)

        def flex_fwd_bwd():
            torch.autograd.grad(flex(qt, kt, vt, block_mask=block_mask, enable_gqa=True), (q, k, v), dot)

        t0 = time.perf_counter()
        flex_fwd()
        flex_fwd_bwd()
        flex_row["compile_s"] = time.perf_counter() - t0
        _measure(flex_row, flex_fwd, flex_fwd_bwd, flops, quick, device)
    except Exception as e:  # noqa: BLE001
        flex_row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return flex_row


# ------------------------------------------------------------------------------ FA4 and flex FLASH
# FlashAttention-4 and flex's FLASH backend (which calls FA4): each in a process of its own.
PEER_IMPLS = ("fa4", "flex_flash")
PEER_TIMEOUT_S = 540  # per process: CuteDSL compiles a forward and a backward per shape; ours tunes each
FA4_BLOCK = (128, 128)  # FA4's Hopper block-sparse backward takes (128, 128) BlockMask blocks
# Relative Frobenius error against block_sparse_attention above which a peer is not timed (bf16
# inputs: both sides round P and O to bf16, so a correct peer sits near 1e-2 or below).
OUT_TOL, GRAD_TOL = 2e-2, 5e-2
FA4_MISSING = ("FlashAttention-4 (flash_attn.cute, flash-attn-4 4.0.0b36 with nvidia-cutlass-dsl 4.8.1) is "
               "not importable here; on the GPU machine install the kit .peers_fa4 with "
               "tools/gpu/peer_kit.sh and put its PYTHONPATH line in the environment")


def _fa4_import_error():
    """None when FA4 can be imported, else why not (the message of the import's exception)."""
    try:
        import flash_attn.cute  # noqa: F401
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or cutlass failing to load its libraries
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


def _fa4_mask_mod(S, window):
    """The DFlash mask as an FA4 CuteDSL mask_mod: ``aux_tensors[0]`` holds the anchors, int32 [B, N].
    Query ``q`` of block ``q // BLOCK`` sees context keys ``kv < anchor`` (and ``kv >= anchor - window``)
    and the BLOCK keys of its own block at ``S + block * BLOCK``. S, window and BLOCK are compile-time
    constants (one compile per shape)."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils as fa_utils

    def const(x):
        return fa_utils.scalar_to_ssa(x, cutlass.Int32)

    if window is None:
        @cute.jit
        def dflash_mask(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
            blk = m_idx // const(BLOCK)
            anchor = const(aux_tensors[0][batch[0], blk[0]])
            own = (n_idx >= const(S)) & ((n_idx - const(S)) // const(BLOCK) == blk)
            return (n_idx < anchor) | own
    else:
        @cute.jit
        def dflash_mask(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
            blk = m_idx // const(BLOCK)
            anchor = const(aux_tensors[0][batch[0], blk[0]])
            ctx = (n_idx < anchor) & (n_idx >= anchor - const(window))
            own = (n_idx >= const(S)) & ((n_idx - const(S)) // const(BLOCK) == blk)
            return ctx | own
    return dflash_mask


def patch_torch_cutedsl_ops() -> list:
    """Give inductor's CuteDSL op overrides the ops flex's FLASH backend needs for a mask_mod that
    indexes a captured tensor; returns the names added.

    torch 2.11's ``torch._inductor.codegen.cutedsl.cutedsl_op_overrides.CuteDSLOpOverrides`` has no
    ``minimum``, ``maximum`` or ``index_expr`` (later torch defines all three on the class: there this
    adds nothing). What they are here: minimum / maximum as a select on a comparison; index_expr as
    torch's own later version, a CSE variable of the kernel's printed, renamed index expression,
    with the index's value bounds, marked a scalar expression that remembers its sympy expression
    (the attributes the CuteDSL kernel reads to tell index arithmetic from tensor values). The same
    three ops as SpecForge's ``specforge/torch_compat.py`` backfills for torch 2.11; written here from
    torch's source, not copied.
    """
    try:
        from torch._inductor.codegen.cutedsl import cutedsl_op_overrides as mod
    except ImportError:
        return []
    cls = mod.CuteDSLOpOverrides
    if getattr(cls, "_dflash_bench_patched", None) is not None:
        return cls._dflash_bench_patched
    own = vars(cls)
    is_211 = torch.__version__.split("+")[0].startswith("2.11.")

    def minimum(a, b):
        return cls.where(cls.lt(a, b), a, b)

    def maximum(a, b):
        return cls.where(cls.gt(a, b), a, b)

    def index_expr(expr, dtype):
        import sympy
        from torch._inductor.utils import get_bounds_index_expr
        from torch._inductor.virtualized import V
        if isinstance(expr, (int, sympy.Integer)):
            return cls.constant(int(expr), dtype)
        kernel = V.kernel
        text = kernel.kexpr(kernel.rename_indexing(expr))
        var = kernel.cse.generate(kernel.body, text, bounds=get_bounds_index_expr(expr), dtype=dtype)
        var.is_scalar_expr = True
        var.index_expr = V.graph.sizevars.simplify(expr)
        return var

    added = []
    for name, fn in (("minimum", minimum), ("maximum", maximum), ("index_expr", index_expr)):
        if is_211 or name not in own:
            setattr(cls, name, staticmethod(fn))
            added.append(name)
    cls._dflash_bench_patched = added
    return added


def _dist_versions(names, module=None) -> str:
    """``name==version`` of installed distributions (pip --target keeps their metadata)."""
    from importlib import metadata
    got = []
    for n in names:
        try:
            got.append(f"{n}=={metadata.version(n)}")
        except metadata.PackageNotFoundError:
            got.append(f"{n}=={getattr(module, '__version__', '?') if module is not None else '?'}")
    return " ".join(got)


def _rel_err(x, ref) -> float:
    x, ref = x.float(), ref.float()
    return float(torch.linalg.vector_norm(x - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))


def _peer_setup(impl, s, device, dtype):
    """Inputs of shape ``s`` (as :func:`_shape_inputs` makes them), our output and gradients for the
    check, and the peer's call ``attn(q, k, v) -> o [B, Tq, Hq, D]``; ``extra`` goes into the row."""
    from dflash_kernels.ops.attention import block_sparse_attention
    from torch.nn.attention.flex_attention import create_block_mask

    B, S, N, Hq, D, W = s["B"], s["S"], s["N"], s["Hq"], s["D"], s["window"]
    Tq, Tk = N * BLOCK, S + N * BLOCK
    anchors, q, k, v, do, mask, pairs = _shape_inputs(s, device, dtype)
    o_ref = block_sparse_attention(q, k, v, mask)
    g_ref = torch.autograd.grad(o_ref, (q, k, v), do)
    o_ref = o_ref.detach()
    scale = D ** -0.5
    extra = {}
    t0 = time.perf_counter()
    block_mask = create_block_mask(_flex_mask_mod(anchors, S, W), B, None, Tq, Tk, device=device,
                                   BLOCK_SIZE=FA4_BLOCK)
    torch.cuda.synchronize()
    extra["mask_ms"] = (time.perf_counter() - t0) * 1e3  # create_block_mask, uncompiled, as for flex
    if impl == "fa4":
        import flash_attn.cute as fa4
        from flash_attn.cute import flash_attn_func
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
        extra["version"] = _dist_versions(("flash-attn-4", "nvidia-cutlass-dsl"), fa4)
        bm = block_mask
        fwd_sparse = BlockSparseTensorsTorch(  # forward: per q block, the kv blocks it visits
            mask_block_cnt=bm.kv_num_blocks, mask_block_idx=bm.kv_indices,
            full_block_cnt=bm.full_kv_num_blocks, full_block_idx=bm.full_kv_indices, block_size=FA4_BLOCK)
        bwd_sparse = BlockSparseTensorsTorch(  # backward: per kv block, the q blocks that visit it
            mask_block_cnt=bm.q_num_blocks, mask_block_idx=bm.q_indices,
            full_block_cnt=bm.full_q_num_blocks, full_block_idx=bm.full_q_indices, block_size=FA4_BLOCK)
        aux = anchors.to(torch.int32).contiguous()
        aux.__leading_dim__ = 1  # FA4's aux-tensor layout hint: the stride-1 mode
        mask_mod = _fa4_mask_mod(S, W)

        def attn(q_, k_, v_):
            out = flash_attn_func(q_, k_, v_, softmax_scale=scale, mask_mod=mask_mod, aux_tensors=[aux],
                                  block_sparse_tensors=fwd_sparse, block_sparse_tensors_bwd=bwd_sparse)
            return out[0] if isinstance(out, tuple) else out
    else:  # flex_flash
        extra["version"] = f"torch=={torch.__version__} " + _dist_versions(("flash-attn-4", "nvidia-cutlass-dsl"))
        extra["patched_cutedsl_ops"] = ",".join(patch_torch_cutedsl_ops()) or "none"
        flex = _compiled_flex()
        opts = {"BACKEND": "FLASH"}

        def attn(q_, k_, v_):
            o = flex(q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2), block_mask=block_mask,
                     scale=scale, enable_gqa=True, kernel_options=opts)
            return o.transpose(1, 2)
    base = {"op": "attention", "shape": _shape_name(s), "dtype": str(dtype), "visible_pairs": pairs}
    return base, extra, (q, k, v, do), (o_ref, g_ref), attn, 4 * D * Hq * pairs


def _peer_shape(impl, s, device, dtype, quick) -> dict:
    """One row: check ``impl`` against block_sparse_attention, then time it (forward; forward +
    backward through torch.autograd.grad over q, k, v)."""
    row = {"op": "attention", "shape": _shape_name(s), "dtype": str(dtype), "impl": impl}
    try:
        base, extra, (q, k, v, do), (o_ref, g_ref), attn, flops = _peer_setup(impl, s, device, dtype)
        row = {**base, "impl": impl, **extra}
        t0 = time.perf_counter()
        with torch.no_grad():
            o = attn(q, k, v)  # compiles the forward
        row["rel_err_out"] = _rel_err(o, o_ref)
        row["compile_s_fwd"] = time.perf_counter() - t0
        if not row["rel_err_out"] <= OUT_TOL:  # NaN fails too
            row["error"] = f"output differs from block_sparse_attention: rel err {row['rel_err_out']:.3g} > {OUT_TOL}"
            return row

        def fwd():
            with torch.no_grad():
                attn(q, k, v)

        row["fwd_ms"] = bench_ms(fwd, quick, True)
        row["fwd_TFLOPs_eff"] = flops / row["fwd_ms"] * 1e-9
        try:
            t0 = time.perf_counter()
            grads = torch.autograd.grad(attn(q, k, v), (q, k, v), do)  # compiles the backward
            row["compile_s_bwd"] = time.perf_counter() - t0
            for name, gx, gr in zip(("dq", "dk", "dv"), grads, g_ref):
                row[f"rel_err_{name}"] = _rel_err(gx, gr)
            worst = max(row["rel_err_dq"], row["rel_err_dk"], row["rel_err_dv"])
            if not worst <= GRAD_TOL:
                row["error"] = f"gradients differ from block_sparse_attention: rel err {worst:.3g} > {GRAD_TOL}"
                return row

            def fwd_bwd():
                torch.autograd.grad(attn(q, k, v), (q, k, v), do)

            row["fwdbwd_ms"] = bench_ms(fwd_bwd, quick, True)
            row["fwdbwd_TFLOPs_eff"] = 3.5 * flops / row["fwdbwd_ms"] * 1e-9
            row["peak_MiB_fwdbwd"] = peak_mib(fwd_bwd, True)
        except Exception as e:  # noqa: BLE001 - the forward's timing stays in the row
            row["error"] = f"backward: {type(e).__name__}: {str(e)[:300]}"
        torch.cuda.synchronize()  # an asynchronous fault shows in this row
    except Exception as e:  # noqa: BLE001 - a failing peer is a row, not a crash
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def peer_child(impl: str, quick: bool) -> None:
    """Rows of one peer (``PEER_IMPLS``) at every shape on stdout as ``ROW {json}``; a ``skipped`` row per
    shape where it cannot run here (no CUDA device, FA4 not installed)."""
    if impl not in PEER_IMPLS:
        raise SystemExit(f"unknown attention peer {impl!r}; one of {PEER_IMPLS}")
    cuda = torch.cuda.is_available()
    shapes = _shapes_and_dtype(cuda, quick)[0]
    why = None if cuda else "needs a CUDA GPU (FA4's kernels are CuteDSL for sm_90 / sm_100)"
    if why is None:
        err = _fa4_import_error()
        why = None if err is None else f"{FA4_MISSING} ({err})"
    if why is None and impl == "flex_flash":
        try:
            from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        except ImportError as e:
            why = f"this torch has no flex_attention: {e}"
    for s in shapes:
        if why is not None:
            row = {"op": "attention", "shape": _shape_name(s), "impl": impl, "skipped": why}
        else:
            print(f"  attention {impl} {_shape_name(s)} ...", flush=True)
            row = _peer_shape(impl, s, torch.device("cuda"), torch.bfloat16, quick)
            torch.cuda.empty_cache()
        print("ROW " + json.dumps(row), flush=True)


def _run_child(impl: str, quick: bool, timeout_s: float) -> list:
    """``child(impl)`` in a fresh process: its rows, or a row saying how the process ended."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", impl] + (["--quick"] if quick else [])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if impl in PEER_IMPLS:
        env.setdefault("DFLASH_KERNELS_TUNE", "0")  # our op only gives the reference there: no tuning time
    return run_rows(cmd, "attention", impl, timeout_s, env)


def _ratios(rows: list) -> None:
    """Ours over every other implementation of the same shape and run (each row's ``process``):
    ``fwd_speedup_vs_<name>``, ``fwdbwd_speedup_vs_<name>``, the name the process's (``flex``, ``fa4``,
    ``flex_flash``), or for SDPA its backend's (``sdpa_cudnn_attention``)."""
    ours = {r["shape"]: r for r in rows if r.get("process") == "dflash_kernels" and "fwd_ms" in r}
    for r in rows:
        o = ours.get(r.get("shape"))
        if o is None or r is o or r.get("process") in (None, "dflash_kernels"):
            continue
        name = r["impl"].replace(" ", "_") if r["process"] == "sdpa" else r["process"]
        for key in ("fwd", "fwdbwd"):
            if f"{key}_ms" in r and f"{key}_ms" in o:
                o[f"{key}_speedup_vs_{name}"] = r[f"{key}_ms"] / o[f"{key}_ms"]


# The chip's attention ceiling in the same run: dense causal SDPA at 8k x 8k, 32 heads.
DENSE_SHAPE = dict(B=2, T=8192, H=32, D=128)


def _bench_dense_causal(device, dtype, quick, with_ours=False, with_sdpa=True) -> list:
    """Dense causal SDPA through each fused backend torch offers, forward and fwd+bwd, with the same
    effective-FLOP count (visible pairs: T (T + 1) / 2 per sequence and head): what a block-sparse
    kernel's effective TFLOP/s can be compared with; with ``with_ours`` first our op under
    ``causal_block_mask`` on the same inputs (the dense causal case of the op)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    B, T, H, D = DENSE_SHAPE["B"], DENSE_SHAPE["T"], DENSE_SHAPE["H"], DENSE_SHAPE["D"]
    q, k, v = (torch.randn(B, H, T, D, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn(B, H, T, D, device=device, dtype=dtype)
    flops = 4 * D * H * B * (T * (T + 1) // 2)
    rows = []
    if with_ours:  # block_sparse_attention under causal_block_mask, on [B, T, H, D] copies of the same inputs
        from dflash_kernels.ops.attention import block_sparse_attention, causal_block_mask

        qo, ko, vo = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        doo = do.transpose(1, 2).contiguous()
        mask = causal_block_mask(T, q_block=64, device=device)
        row = {"op": "attention", "shape": f"B={B},T={T},H={H},D={D},causal dense", "dtype": str(dtype),
               "visible_pairs": B * T * (T + 1) // 2, **_ours_label(qo, ko, vo, mask)}

        def fwd():
            with torch.no_grad():
                block_sparse_attention(qo, ko, vo, mask)

        def fwd_bwd():
            torch.autograd.grad(block_sparse_attention(qo, ko, vo, mask), (qo, ko, vo), doo)

        try:
            fwd_bwd()
            _measure(row, fwd, fwd_bwd, flops, quick, device)
        except Exception as e:  # noqa: BLE001 - report, keep the run going
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        if not with_sdpa:
            return rows
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        row = {"op": "attention", "shape": f"B={B},T={T},H={H},D={D},causal dense",
               "dtype": str(dtype), "visible_pairs": B * T * (T + 1) // 2, "impl": f"sdpa {name.lower()}"}
        backend = getattr(SDPBackend, name)

        def fwd():
            with torch.no_grad(), sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd():
            with sdpa_kernel(backend):
                torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), do)

        try:
            fwd_bwd()
            _measure(row, fwd, fwd_bwd, flops, quick, device)
        except Exception as e:  # noqa: BLE001 - a backend this build lacks: say so, keep the run going
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
    return rows


ALL_IMPLS = ("dflash_kernels", "flex", "sdpa") + PEER_IMPLS


def _shapes_and_dtype(cuda: bool, quick: bool):
    return ((SHAPES[:1] if quick else SHAPES), torch.bfloat16) if cuda else ([CPU_SHAPE], torch.float32)


def child(impl: str, quick: bool) -> None:
    """Rows of one implementation (``ALL_IMPLS``) on stdout as ``ROW {json}``, run in its own process by
    ``run``; ``flex`` and ``sdpa`` give a ``skipped`` row without a GPU."""
    if impl in PEER_IMPLS:
        peer_child(impl, quick)
        return
    if impl not in ALL_IMPLS:
        raise SystemExit(f"unknown attention implementation {impl!r}; one of {ALL_IMPLS}")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shapes, dtype = _shapes_and_dtype(cuda, quick)
    if impl != "dflash_kernels" and not cuda:
        print("ROW " + json.dumps({"op": "attention", "impl": impl, "skipped": "needs a CUDA GPU"}), flush=True)
        return
    if impl == "sdpa":
        dense = _bench_dense_causal(device, dtype, quick, with_ours=False, with_sdpa=True)
    else:
        bench = _bench_ours if impl == "dflash_kernels" else _bench_flex
        for s in shapes:
            print(f"  attention {impl} {_shape_name(s)} ...", flush=True)
            print("ROW " + json.dumps(bench(s, device, dtype, quick)), flush=True)  # a run cut short keeps it
            if cuda:
                torch.cuda.empty_cache()
        # ours: the dense causal case of the op too, beside SDPA's rows
        dense = _bench_dense_causal(device, dtype, quick, True, False) if impl == "dflash_kernels" and cuda else []
    for r in dense:
        print("ROW " + json.dumps(r), flush=True)


def run(device, quick: bool, impls=None, peer_timeout_s: float = PEER_TIMEOUT_S) -> list:
    """Rows for ``benchmarks/ops.py attention``: each implementation of ``impls`` (a subset of ``ALL_IMPLS``,
    default all) in a process of its own, in that order (without a GPU: ours only), then ours over each of
    the others at the same shape (``_ratios``). ``device`` says whether a GPU is to be used."""
    device = torch.device(device)
    impls = set(ALL_IMPLS if not impls else impls)
    unknown = impls - set(ALL_IMPLS)
    if unknown:
        raise SystemExit(f"unknown attention implementation(s) {sorted(unknown)}; of {ALL_IMPLS}")
    rows = []
    for impl in ALL_IMPLS:
        if impl not in impls:
            continue
        if device.type != "cuda" and impl != "dflash_kernels":  # said once, not run: they need a GPU
            print(f"  attention {impl}: skipped (needs a CUDA GPU)", flush=True)
            continue
        print(f"attention: {impl} (a process of its own, {peer_timeout_s:.0f} s limit)", flush=True)
        rows += _run_child(impl, quick, peer_timeout_s)
    _ratios(rows)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the first shape only, fewer repetitions")
    parser.add_argument("--impls", default="", help=f"comma-separated subset of {', '.join(ALL_IMPLS)} (default all)")
    parser.add_argument("--timeout", type=float, default=PEER_TIMEOUT_S,
                        help="seconds each implementation's process may run")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)  # one implementation's rows on stdout
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.quick)
        return
    impls = [i for i in args.impls.split(",") if i] or None
    for r in run("cuda" if torch.cuda.is_available() else "cpu", args.quick, impls, args.timeout):
        print(r)


if __name__ == "__main__":
    main()
