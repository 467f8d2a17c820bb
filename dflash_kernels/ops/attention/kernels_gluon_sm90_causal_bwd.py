"""Warp-specialized Hopper (sm_90) backward in Gluon for dense causal attention: the op (attention.py) runs it
after the Gluon causal forward (kernels_gluon_sm90.py). Tests: tests/ops/test_attention_gluon_sm90_causal_bwd.py.
``python -m tools.studies.debug_causal_bwd`` is its diagnostic (per-case subprocesses, per-block / per-row error
patterns of dk / dv), and
``DFLASH_CAUSAL_BWD_VARIANT`` (an int, read by the launcher; diagnostic only) sets the dk / dv kernel's
``VARIANT`` bits: 1 the diagonal mask by selects after the score MMAs instead of in their initial accumulators,
2 no off-diagonal items, 4 no diagonal items (0, the default: the kernel as designed). Bits 8 to 64 each change
one thing to what the GPU-verified DFlash dk / dv kernel does: 8 the consumers recompute the program's batch,
kv head and first key from ``gl.program_id(0)`` (``NBH`` passed in place of ``coords``) instead of reading the
``coords`` shared buffer that ``_stash_coords`` wrote before ``gl.warp_specialize`` (still written); 16 Q and
dO through rank-4 TMA descriptors with ``[1, 64, 1, D]`` boxes over ``[B, Tq, Hq, D]`` (the DFlash launcher's
``row_descriptor(x, 64, 1)``, coordinates ``[b, m, h, 0]``; the launcher and tools/studies/gluon_sm90_compile.py
build them when the bit is set) instead of rank-3 ``[1, 64, D]`` boxes over ``[B, Tq, Hq * D]``; 32 the
producer's lse / delta offsets as the DFlash producer's, ``(b.to(int64) * Hq + h) * Tq + t`` per lane, instead
of the ``_wide`` scalar row plus 32-bit lane offsets; 64 a ``fence_async_shared()`` before the producer's
``thread_barrier`` after its row stores on the non-suspect path (a memory-ordering hypothesis; the DFlash order,
row stores after the ``empty`` wait, is kept); 128 the two consumer warpgroups swap their 64-key blocks (does
an error follow the partition or the keys?); 256 the first design, a second (unmasked) call site of the item
for the items off the diagonal: wrong dk / dv on the GPU (below); 512 the query tiles in descending order, so
that each block's diagonal item comes last (the DFlash kernel's order: whole items first, masked ones last).
Bits combine;
tools/studies/debug_causal_bwd.py's ``--variant`` runs them (e.g. ``--variant 8,16,32,64,8+16+32+64``).

The design: the sibling of the dense causal forward in kernels_gluon_sm90.py (same masks, layouts and lse),
built like the DFlash backward (kernels_gluon_sm90_dflash_bwd.py: read its docstring for the partitions, the
ring and the barrier protocol, which this module keeps). Causal is top-left aligned, the convention of
``causal_block_mask`` (mask.py) and of the forward: query ``t`` sees key ``j`` iff ``j <= t`` (every key when
``t >= Tk``); ``Tq != Tk`` is allowed.
Two kernels, deterministic (fixed summation orders, no atomics), after the portable preprocess
(``delta = rowsum(o * do)``, kernels.py).

dk / dv (``_attn_bwd_causal_dkdv_ws_kernel``): one program per (batch, kv head, key tile of ``BN = 128`` keys
``[n0, n0 + 128)``); consumer warpgroup ``w`` (two of them) owns keys ``n0 + 64 w + [0, 64)`` and holds their
dk, dv ``[64, D]`` fp32 in registers (keys on the warpgroup MMA's M side). The queries that see the tile are
``[n0, Tq)``, cut into 64-row query tiles ``m = n0 + 64 qt``; an *item* is one query tile of one query head
of the kv head's GQA group, query tile outer and head inner (``i = qt * G + head``: the G heads of one
position range are adjacent in memory), so dk / dv sum over the whole group in registers in a fixed order.
Per item and consumer (the DFlash kernel's products)::

    S^T = K Q^T, P^T = exp2(S^T * scale * log2 e - lse2), dP^T = V dO^T, dS^T = P^T (dP^T - delta),
    dV += P^T dO, dK += dS^T Q

and ``dK *= scale`` at the end. Consumer ``w`` against query tile ``qt``: ``qt > w`` every key of its block
lies left of every row's diagonal, no mask; ``qt == w`` the block is the tile's diagonal block, P^T and dS^T
are made exactly 0 where key > query (the mask goes into the score MMAs' initial accumulators); ``qt < w``
(consumer 1 against the first tile) no key is seen, the item only takes part in the barrier protocol. So each
consumer masks one item per head. All items go through one code path, the masked one (the mask, from a
runtime shift, is all-true off the diagonal): with a second, unmasked call site for the items off the
diagonal (VARIANT bit 256) the H100 gave wrong dk / dv and faulted at D = 64. Rows past ``Tq`` read zeros
(TMA) and have lse -inf, so P^T = 0 there; keys past ``Tk`` read zeros and are not stored. Programs run key
tile 0 first, heads fastest: the first key tiles have the most query tiles (the longest programs start first).

The producer warp TMA-loads K and V of the tile once (four 64-key boxes), then every item's Q and dO boxes
(``[1, 64, D]`` of the ``[B, Tq, Hq * D]`` views) into a ring of ``NUM_STAGES`` stages, with the item's row
terms (``-lse / scale`` and ``-delta``: the score MMAs' initial accumulators) in a per-stage row buffer.
Barriers ``kv_bar``, ``ready``, ``empty`` and ``landed`` are the DFlash kernel's, with its counts and phases;
there is no flag word (below). The consumers read their program's coordinates for the epilogue's stores from
a small shared buffer written before the partitions start: held in registers across the item loop, they
spilled.

Non-finite values stay with the rows and keys that meet them (the portable kernels' contract: kernels.py,
tests/ops/test_nonfinite.py). The diagonal items put the causal mask into the score MMAs' initial
accumulators by selects (-inf for S^T, 0 for dP^T where key > query: ``_causal_dkdv_item``), so P^T and dS^T
are exactly 0 where a row does not see a key whatever the row terms are, unless the product itself is not
finite. A non-finite K or V row of key ``j`` makes only row ``j`` of S^T / dP^T non-finite: it reaches dk / dv
of key ``j`` only; the rows that see it (non-finite o, lse, delta) reach the keys they see. A non-finite
element of q or do *itself* (an upstream NaN) would meet, in a diagonal item, the ``P^T = 0`` of the keys its
row does not see inside the MMAs (``0 * NaN``: Q and dO are the B operands). Such a row has a non-finite lse
or delta (kernels_gluon_sm90_dflash_bwd.py's docstring says why), so the producer treats a diagonal item
(``qt < 2``) with a live row whose lse or delta is not finite as *suspect*: it loads the boxes through
``landed``, zeroes their non-finite elements in place (``_zero_nonfinite``) and sets both row terms of every
row whose lse or delta is not finite to NaN before it announces the stage (a plain arrival). Those rows' P^T
and dS^T are then NaN on exactly the keys they see (the selects keep the others at -inf / 0), and every other
product reads finite boxes. The rows marked this way include those whose row terms are non-finite through a
key they see; their NaN reaches only keys they see, which their non-finite o reaches anyway. Unmasked items
need nothing: every row sees every key of the consumer's block. The common case pays a reduction per item in
the producer.

dq (``_attn_bwd_causal_dq_ws_kernel``): one program per (batch, query head, 128-row tile ``m0``), the
forward's grid and order (the last row tiles, with the most keys, first); consumer ``w`` owns rows
``m0 + 64 w + [0, 64)``. The producer TMA-loads K and V tiles of keys ``[0, min(Tk, m0 + 128))`` into the
forward's ring (``_load_kv``, ``_init_ring`` of kernels_gluon_sm90.py; no ping-pong turns). Q, dO, lse, delta
are loaded once with plain loads. Per key tile::

    S = Q K^T, dP = dO V^T, P = exp2(S * scale * log2 e - lse2), dS = P (dP - delta), dQ += dS K

and ``dQ *= scale`` at the end. A tile right of every row of a consumer (``n > r0 + 63``) is skipped by that
consumer (barriers only); tiles that cross its rows' diagonal or ``Tk`` select dS to 0 on unseen keys, and
``dQ += dS K`` reads a copy of the K tile in the consumer's own shared slot (``k_smem`` slots
``NUM_STAGES + w``) with its non-finite elements set to 0 (``_finite_keys``): a non-finite key reaches the rows
that see it through S, hence P and dS, so the MMA may take the finite keys only (the portable dq kernel's
rule); unseen keys then add exactly 0. A non-finite V reaches dP's column only, selected away where unseen.
Non-finite q or do: A operands (rows on the M side), they reach only their own row.

Tiles, stages and shared memory are the DFlash backward's (``dkdv_config``, ``dq_config``): dk / dv 160 KiB
at D = 128 (K, V 64 KiB; three stages of Q and dO 96 KiB), dq 192 KiB at D = 128.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from dflash_kernels.ops.attention.kernels_gluon_sm90 import (CONSUMER_REGS, GLUON_CONFIGS, LOG2E, PRODUCER_REGS,
                                                             _init_ring, _load_kv, descriptor, score_layout)
from dflash_kernels.ops.attention.kernels_gluon_sm90_dflash_bwd import (KH, _dkdv_store, _zero_nonfinite,
                                                                        dkdv_config, dq_config, row_descriptor)
from dflash_kernels.runtime import TritonKernel, alloc, bucket, cdiv

__all__ = ["attention_bwd_gluon_sm90_causal"]

_LOG2E: gl.constexpr = gl.constexpr(LOG2E)
BN_KV = 2 * KH  # keys per dk / dv program: two consumer warpgroups of 64
ROWS = 64  # query rows per dk / dv item (the score MMAs' N) and per dq consumer (their M)
BM_Q = 2 * ROWS  # query rows per dq program: two consumer warpgroups
_ROWS: gl.constexpr = gl.constexpr(ROWS)


# ------------------------------------------------------------------------------------------------ dk / dv


@gluon.jit
def _stash_coords(buf, b, hk, n0):
    """Store the program's batch, kv head and first key into the shared int32 ``buf`` [4] (every thread the
    same values: no barrier needed beyond the one that starts the partitions)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    i = gl.arange(0, 4, layout)
    buf.store(gl.where(i == 0, b, gl.where(i == 1, hk, n0)))


@gluon.jit
def _load_coords(buf):
    """The batch, kv head and first key ``_stash_coords`` stored (all non-negative)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    i = gl.arange(0, 4, layout)
    x = buf.load(layout)
    return gl.max(gl.where(i == 0, x, -1), 0), gl.max(gl.where(i == 1, x, -1), 0), gl.max(gl.where(i == 2, x, -1), 0)


@gluon.jit
def _wide(x):
    """The non-negative int32 ``x`` as int64 by zero extension: its high word is the constant 0, where a sign
    extension of a kernel argument is a register that the producer's 24 kept alive across its loop (a spill)."""
    return x.to(gl.uint32).to(gl.int64)


@gluon.jit
def _causal_dkdv_producer(q_desc, do_desc, k_desc, v_desc, lse_ptr, delta_ptr, q_smem, do_smem, k_smem, v_smem,
                          row_smem, kv_bar, landed, ready, empty, b, hk, n0, n_items, Tq, Hq, sm_scale,
                          G: gl.constexpr, NUM_STAGES: gl.constexpr, VARIANT: gl.constexpr = 0):
    """K and V of the program's key tile, then Q, dO and the row terms of every item into the ring; a suspect
    diagonal item's boxes with their non-finite elements zeroed and the terms of its rows whose lse or delta is
    not finite NaN (module docstring). VARIANT bits 16, 32, 64: debug (module docstring)."""
    R: gl.constexpr = q_desc.block_type.shape[1]
    if (VARIANT & 16) != 0:  # rank-4 [1, R, 1, D] boxes of the [B, Tq, Hq, D] views
        D: gl.constexpr = q_desc.block_type.shape[3]
    else:
        D: gl.constexpr = q_desc.block_type.shape[2]
    KR: gl.constexpr = k_desc.block_type.shape[1]
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [b, n0 + w * KR, hk * D], kv_bar, k_smem.index(w))
        tma.async_copy_global_to_shared(v_desc, [b, n0 + w * KR, hk * D], kv_bar, v_smem.index(w))

    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    nbytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes
    r = gl.arange(0, R, row_layout)
    n_landed = 0  # items loaded through `landed` so far: its phase
    for i in range(n_items):
        stage = i % NUM_STAGES
        if (VARIANT & 512) != 0:  # debug: the query tiles in descending order (diagonal last)
            qt = n_items // G - 1 - i // G
        else:
            qt = i // G
        h = hk * G + i % G
        m = n0 + qt * R
        ok = r < Tq - m
        # Row terms before the stage wait (their latency overlaps it). lse -inf (rows past Tq) gives -inf:
        # P = 0 exactly there.
        if (VARIANT & 32) != 0:  # debug: the DFlash producer's per-lane int64 row offsets
            row_v = (b.to(gl.int64) * Hq + h) * Tq + (m + r)
            lse = gl.load(lse_ptr + row_v, mask=ok, other=float("-inf"))
            dlt = gl.load(delta_ptr + row_v, mask=ok, other=0.0)
        else:
            row = _wide(b * Hq + h) * _wide(Tq) + m  # a scalar: 32-bit vector offsets (few registers)
            lse = gl.load(lse_ptr + row + r, mask=ok, other=float("-inf"))
            dlt = gl.load(delta_ptr + row + r, mask=ok, other=0.0)
        nlse = gl.where(lse == float("-inf"), float("-inf"), -lse / sm_scale)
        # Every live row sees key 0, so a non-finite lse (-inf too) or delta means a non-finite input.
        fine = (gl.abs(lse) < float("inf")) & (gl.abs(dlt) < float("inf"))  # NaN compares False
        suspect = (qt < 2) & (gl.max(gl.where(ok, 1 - fine.to(gl.int32), 0), axis=0) != 0)
        mbarrier.wait(empty.index(stage), ((i // NUM_STAGES) & 1) ^ 1)
        q_stage = q_smem.index(stage)
        do_stage = do_smem.index(stage)
        if suspect:
            # Rare: load, zero the non-finite elements in place and NaN the terms of the rows that are not
            # fine (before either consumer reads the stage), then announce the stage with a plain arrival.
            mbarrier.expect(landed, nbytes)
            if (VARIANT & 16) != 0:
                tma.async_copy_global_to_shared(q_desc, [b, m, h, 0], landed, q_stage)
                tma.async_copy_global_to_shared(do_desc, [b, m, h, 0], landed, do_stage)
            else:
                tma.async_copy_global_to_shared(q_desc, [b, m, h * D], landed, q_stage)
                tma.async_copy_global_to_shared(do_desc, [b, m, h * D], landed, do_stage)
            mbarrier.wait(landed, n_landed & 1)
            n_landed += 1
            _zero_nonfinite(q_stage)
            _zero_nonfinite(do_stage)
            bad = ok & ~fine
            row_smem.index(2 * stage).store(gl.where(bad, float("nan"), nlse))
            row_smem.index(2 * stage + 1).store(gl.where(bad, float("nan"), -dlt))
            fence_async_shared()  # the zeroing stores before the consumers' MMAs (async proxy) read the stage
            gl.thread_barrier()  # every lane's stores before the (one-lane) arrival below
            mbarrier.arrive(ready.index(stage))
        else:
            row_smem.index(2 * stage).store(nlse)
            row_smem.index(2 * stage + 1).store(-dlt)
            if (VARIANT & 64) != 0:  # debug: a proxy fence too (a memory-ordering hypothesis)
                fence_async_shared()
            gl.thread_barrier()  # every lane's row stores before the (one-lane) arrival below
            bar = ready.index(stage)
            mbarrier.expect(bar, nbytes)
            if (VARIANT & 16) != 0:
                tma.async_copy_global_to_shared(q_desc, [b, m, h, 0], bar, q_stage)
                tma.async_copy_global_to_shared(do_desc, [b, m, h, 0], bar, do_stage)
            else:
                tma.async_copy_global_to_shared(q_desc, [b, m, h * D], bar, q_stage)
                tma.async_copy_global_to_shared(do_desc, [b, m, h * D], bar, do_stage)


@gluon.jit
def _causal_dkdv_item(dk, dv, kt, vt, q, do, rows_buf, stage, qk_scale, shift, DIAGONAL: gl.constexpr,
                      s_layout: gl.constexpr, o_layout: gl.constexpr, POST: gl.constexpr = False):
    """One item: dV += P^T dO and dK += dS^T Q in place. The two score-side MMAs start from the row terms of
    the stage's row buffer broadcast over the keys (no registers held for them beside the accumulators) and
    are issued together, P^T computed while dP^T runs.

    ``DIAGONAL``: the causal mask goes into those initial accumulators, where key > query, by selects: -inf
    for S^T (P^T = exp2(-inf) = 0) and 0 for dP^T, so that P^T and dS^T are exactly 0 there without a select
    after the MMAs (where the registers are busiest). What a product can still bring there is non-finite only
    through the key's own K or V (its own dk, dv) or a non-finite q / do element (zeroed by the producer:
    module docstring), and a NaN row term (the producer's mark of such a row) is replaced too. ``shift`` is the
    item's first row minus the consumer's first key (0 on the diagonal: a runtime value, so that the mask is
    not hoisted out of the item loop and held in registers across it)."""
    KROWS: gl.constexpr = kt.shape[0]
    R: gl.constexpr = q.shape[0]
    dtype: gl.constexpr = q.dtype
    row_vec: gl.constexpr = gl.SliceLayout(0, s_layout)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    nlse = gl.zeros([KROWS, R], gl.float32, s_layout) + gl.expand_dims(rows_buf.index(2 * stage).load(row_vec), 0)
    if DIAGONAL:
        keys = gl.arange(0, KROWS, gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, R, row_vec) + shift
        seen = gl.expand_dims(keys, 1) <= gl.expand_dims(cols, 0)
        if not POST:
            nlse = gl.where(seen, nlse, float("-inf"))
    st = warpgroup_mma(kt, q.permute((1, 0)), nlse, is_async=True)
    ndlt = gl.zeros([KROWS, R], gl.float32, s_layout) + \
        gl.expand_dims(rows_buf.index(2 * stage + 1).load(row_vec), 0)
    if DIAGONAL:
        if not POST:
            ndlt = gl.where(seen, ndlt, 0.0)
    dpt = warpgroup_mma(vt, do.permute((1, 0)), ndlt, is_async=True)
    st = warpgroup_mma_wait(1, deps=(st, ))  # in order: one outstanding means S^T is done
    pt = gl.exp2(st * qk_scale)
    dpt = warpgroup_mma_wait(0, deps=(dpt, ))
    dst = pt * dpt
    if DIAGONAL:
        if POST:  # debug variant (DFLASH_CAUSAL_BWD_VARIANT bit 1): the mask by selects after the MMAs
            pt = gl.where(seen, pt, 0.0)
            dst = gl.where(seen, dst, 0.0)
    p_op = gl.convert_layout(pt.to(dtype), op_layout)
    ds_op = gl.convert_layout(dst.to(dtype), op_layout)
    dv = warpgroup_mma(p_op, do, dv, is_async=True)
    dk = warpgroup_mma(ds_op, q, dk, is_async=True)
    dk, dv, p_op, ds_op = warpgroup_mma_wait(0, deps=(dk, dv, p_op, ds_op))
    return dk, dv


@gluon.jit
def _causal_dkdv_consumer(dk_ptr, dv_ptr, q_smem, do_smem, k_smem, v_smem, row_smem, kv_bar, ready, empty,
                          coords, n_items, Tk, Hkv, qk_scale, sm_scale, WG: gl.constexpr, G: gl.constexpr,
                          NUM_STAGES: gl.constexpr, VARIANT: gl.constexpr = 0):
    """Consumer warpgroup ``WG``: dK, dV of keys ``n0 + 64 WG + [0, 64)`` over every item of the program.
    With VARIANT bit 8 (debug) ``coords`` is ``NBH`` (an int) and the coordinates come from the program id;
    with bit 128 (debug) the two warpgroups swap their key blocks (``WG`` 0 takes keys ``n0 + 64 + [0, 64)``)."""
    if (VARIANT & 128) != 0:
        KB: gl.constexpr = 1 - WG
    else:
        KB: gl.constexpr = WG
    R: gl.constexpr = q_smem.shape[2]
    if (VARIANT & 16) != 0:  # rank-4 [1, R, 1, D] boxes
        D: gl.constexpr = q_smem.shape[4]
    else:
        D: gl.constexpr = q_smem.shape[3]
    KROWS: gl.constexpr = k_smem.shape[2]
    s_layout: gl.constexpr = score_layout(R)
    o_layout: gl.constexpr = score_layout(D)
    dk = gl.zeros([KROWS, D], gl.float32, o_layout)
    dv = gl.zeros([KROWS, D], gl.float32, o_layout)
    kt = k_smem.index(KB).reshape([KROWS, D])
    vt = v_smem.index(KB).reshape([KROWS, D])
    mbarrier.wait(kv_bar, 0)
    for i in range(n_items):
        stage = i % NUM_STAGES
        if (VARIANT & 512) != 0:  # debug: the query tiles in descending order (diagonal last)
            qt = n_items // G - 1 - i // G
        else:
            qt = i // G
        # Waited for also when the item is skipped: the arrival below then cannot fall into an earlier phase.
        mbarrier.wait(ready.index(stage), (i // NUM_STAGES) & 1)
        q = q_smem.index(stage).reshape([R, D])
        do = do_smem.index(stage).reshape([R, D])
        shift = (qt - KB) * R
        # Every item the consumer sees (qt >= KB) goes through one call site, the masked one: its mask, from
        # the runtime shift, is all-true off the diagonal. With a second, unmasked call site for the items
        # off the diagonal (VARIANT bit 256, debug) the H100 gave wrong dk / dv for the first 64 keys of
        # every tile and faulted at D = 64 (benchmarks/results/README.md).
        # VARIANT (debug, DFLASH_CAUSAL_BWD_VARIANT): bit 1 the diagonal mask after the MMAs, bit 2 no
        # off-diagonal items, bit 4 no diagonal items.
        if (VARIANT & 256) == 0:
            run = qt >= KB
            if (VARIANT & 2) != 0:
                run = qt == KB
            if (VARIANT & 4) != 0:
                run = qt > KB
            if run:
                dk, dv = _causal_dkdv_item(dk, dv, kt, vt, q, do, row_smem, stage, qk_scale, shift, True,
                                           s_layout, o_layout, (VARIANT & 1) != 0)
        elif qt > KB:
            if (VARIANT & 2) == 0:
                dk, dv = _causal_dkdv_item(dk, dv, kt, vt, q, do, row_smem, stage, qk_scale, shift, False,
                                           s_layout, o_layout)
        elif qt == KB:
            if (VARIANT & 4) == 0:
                dk, dv = _causal_dkdv_item(dk, dv, kt, vt, q, do, row_smem, stage, qk_scale, shift, True,
                                           s_layout, o_layout, (VARIANT & 1) != 0)
        mbarrier.arrive(empty.index(stage))
    # Every MMA that read this consumer's K / V boxes has completed: they stage the stores. The program's
    # coordinates come from shared memory: held in registers across the loop, they spilled to local memory.
    if (VARIANT & 8) != 0:  # debug: recomputed from the program id (``coords`` is NBH), as the kernel does
        pid = gl.program_id(0)
        pid_bh = pid % coords
        b = pid_bh // Hkv
        hk = pid_bh % Hkv
        n0 = (pid // coords) * (2 * KROWS)
    else:
        b, hk, n0 = _load_coords(coords)
    first = n0 + KB * KROWS
    _dkdv_store(dk * sm_scale, k_smem.index(KB), dk_ptr, b, hk, first, Tk, Hkv, D)
    _dkdv_store(dv, v_smem.index(KB), dv_ptr, b, hk, first, Tk, Hkv, D)


@gluon.jit
def _attn_bwd_causal_dkdv_ws_kernel(q_desc, do_desc, k_desc, v_desc, dk_ptr, dv_ptr, lse_ptr, delta_ptr, Tq, Tk,
                                    Hq, Hkv, NBH, qk_scale, sm_scale, G: gl.constexpr,
                                    NUM_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                    PRODUCER_REGS: gl.constexpr, VARIANT: gl.constexpr = 0):
    """One program: the 128-key tile ``pid // NBH`` of (batch, kv head) ``pid % NBH`` (``NBH = B * Hkv``),
    key tiles ascending (the longest programs first), heads fastest. ``VARIANT``: debug bits (module
    docstring; 0 the kernel as designed)."""
    R: gl.constexpr = q_desc.block_type.shape[1]
    if (VARIANT & 16) != 0:  # debug: rank-4 [1, R, 1, D] boxes of the [B, Tq, Hq, D] views
        gl.static_assert(q_desc.block_type.shape[2] == 1, "one head per box")
        D: gl.constexpr = q_desc.block_type.shape[3]
    else:
        D: gl.constexpr = q_desc.block_type.shape[2]
    KROWS: gl.constexpr = k_desc.block_type.shape[1]
    gl.static_assert((D == 64) or (D == 128), "head dim 64 or 128")
    gl.static_assert(KROWS == 64, "a consumer warpgroup owns 64 keys")
    gl.static_assert(R == KROWS, "query tiles as tall as a consumer's key block: one diagonal item each")

    pid = gl.program_id(0)
    pid_bh = pid % NBH
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    n0 = (pid // NBH) * (2 * KROWS)
    # Query tiles [n0, Tq) of 64 rows, times the G heads; none when the tile starts at or past Tq.
    n_items = gl.where(Tq > n0, gl.cdiv(Tq - n0, R), 0) * G

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [NUM_STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [NUM_STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    row_smem = gl.allocate_shared_memory(gl.float32, [2 * NUM_STAGES, R],
                                         gl.SwizzledSharedLayout(1, 1, 1, order=[0]))  # per-row-vector layout
    coords = gl.allocate_shared_memory(gl.int32, [4], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    _stash_coords(coords, b, hk, n0)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    landed = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(landed, count=1)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    # The barriers are completed by TMA (the async proxy): make their initialisation visible to it.
    fence_async_shared()

    if (VARIANT & 8) != 0:
        # Debug: the consumers recompute their coordinates from the program id (NBH in place of ``coords``).
        gl.warp_specialize([
            (_causal_dkdv_consumer, (dk_ptr, dv_ptr, q_smem, do_smem, k_smem, v_smem, row_smem, kv_bar, ready,
                                     empty, NBH, n_items, Tk, Hkv, qk_scale, sm_scale, 0, G, NUM_STAGES, VARIANT)),
            (_causal_dkdv_consumer, (dk_ptr, dv_ptr, q_smem, do_smem, k_smem, v_smem, row_smem, kv_bar, ready,
                                     empty, NBH, n_items, Tk, Hkv, qk_scale, sm_scale, 1, G, NUM_STAGES, VARIANT)),
            (_causal_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, lse_ptr, delta_ptr, q_smem, do_smem, k_smem,
                                     v_smem, row_smem, kv_bar, landed, ready, empty, b, hk, n0,
                                     n_items, Tq, Hq, sm_scale, G, NUM_STAGES, VARIANT)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_causal_dkdv_consumer, (dk_ptr, dv_ptr, q_smem, do_smem, k_smem, v_smem, row_smem, kv_bar, ready,
                                     empty, coords, n_items, Tk, Hkv, qk_scale, sm_scale, 0, G, NUM_STAGES,
                                     VARIANT)),
            (_causal_dkdv_consumer, (dk_ptr, dv_ptr, q_smem, do_smem, k_smem, v_smem, row_smem, kv_bar, ready,
                                     empty, coords, n_items, Tk, Hkv, qk_scale, sm_scale, 1, G, NUM_STAGES,
                                     VARIANT)),
            (_causal_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, lse_ptr, delta_ptr, q_smem, do_smem, k_smem,
                                     v_smem, row_smem, kv_bar, landed, ready, empty, b, hk, n0,
                                     n_items, Tq, Hq, sm_scale, G, NUM_STAGES, VARIANT)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ------------------------------------------------------------------------------------------------------ dq


@gluon.jit
def _finite_keys(k_smem, stage, dst, BN: gl.constexpr, D: gl.constexpr):
    """Copy the K tile in ring slot ``stage`` into slot ``dst`` of ``k_smem`` with its non-finite elements set
    to 0 (a select), for ``dQ += dS K`` on a masked tile. The caller has waited for the tile and for every MMA
    that read ``dst``."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [4, 1], [1, 0])
    CH: gl.constexpr = 32  # keys at a time: 16 registers a thread at D = 128
    src = k_smem.index(stage).reshape([BN, D])
    dst_buf = k_smem.index(dst).reshape([BN, D])
    for c in gl.static_range(BN // CH):
        x = src.slice(c * CH, CH).load(layout)
        fine = gl.abs(x.to(gl.float32)) < float("inf")  # NaN compares False
        dst_buf.slice(c * CH, CH).store(gl.where(fine, x, gl.zeros_like(x)))
    # The MMA reads the copy through the async proxy, after every thread of the warpgroup has written its part.
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _causal_dq_consumer(q_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, q_smem, do_smem, k_smem, v_smem, k_ready,
                        k_empty, v_ready, v_empty, b, h, m0, Tq, Tk, Hq, n_tiles, qk_scale, sm_scale,
                        WG: gl.constexpr, BN: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Consumer warpgroup ``WG``: dQ of rows ``m0 + 64 WG + [0, 64)`` of head ``h`` over the program's keys."""
    R: gl.constexpr = q_smem.shape[1]
    D: gl.constexpr = q_smem.shape[2]
    dtype: gl.constexpr = q_smem.dtype
    OWN: gl.constexpr = NUM_STAGES + WG
    s_layout: gl.constexpr = score_layout(BN)
    o_layout: gl.constexpr = score_layout(D)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [4, 1], [1, 0])

    r0 = m0 + WG * R
    t = r0 + gl.arange(0, R, gl.SliceLayout(1, io_layout))
    live = gl.expand_dims(t < Tq, 1)
    offs = gl.expand_dims(((b.to(gl.int64) * Tq + t) * Hq + h) * D, 1) + \
        gl.expand_dims(gl.arange(0, D, gl.SliceLayout(0, io_layout)), 0)
    q = q_smem.index(WG)
    do = do_smem.index(WG)
    q.store(gl.load(q_ptr + offs, mask=live, other=0.0))
    do.store(gl.load(do_ptr + offs, mask=live, other=0.0))
    rows = r0 + gl.arange(0, R, gl.SliceLayout(1, s_layout))
    live_s = rows < Tq
    row = (b.to(gl.int64) * Hq + h) * Tq + rows
    lse2 = gl.load(lse_ptr + row, mask=live_s, other=float("-inf")) * _LOG2E
    lse2 = gl.expand_dims(gl.where(lse2 == float("-inf"), float("inf"), lse2), 1)  # P = 0 on dead rows
    dlt = gl.expand_dims(gl.load(delta_ptr + row, mask=live_s, other=0.0), 1)
    fence_async_shared()  # the warpgroup MMAs read q and do through the async proxy

    dq = gl.zeros([R, D], gl.float32, o_layout)
    zero = gl.zeros([R, BN], gl.float32, s_layout)
    for j in range(n_tiles):
        stage = j % NUM_STAGES
        phase = (j // NUM_STAGES) & 1
        n = j * BN
        mbarrier.wait(k_ready.index(stage), phase)
        if n <= r0 + R - 1:  # the consumer's last row sees a key of the tile
            s = warpgroup_mma(q, k_smem.index(stage).reshape([BN, D]).permute((1, 0)), zero, use_acc=False,
                              is_async=True)
            mbarrier.wait(v_ready.index(stage), phase)
            dp = warpgroup_mma(do, v_smem.index(stage).reshape([BN, D]).permute((1, 0)), zero, use_acc=False,
                               is_async=True)
            s = warpgroup_mma_wait(1, deps=(s, ))
            p = gl.exp2(s * qk_scale - lse2)
            dp = warpgroup_mma_wait(0, deps=(dp, ))
            mbarrier.arrive(v_empty.index(stage))
            ds = p * (dp - dlt)
            masked = (n + BN - 1 > r0) | (n + BN > Tk)
            if masked:
                cols = n + gl.arange(0, BN, gl.SliceLayout(0, s_layout))
                seen = (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1)) & gl.expand_dims(cols < Tk, 0)
                # A select, not a product: dS of unseen keys is exactly 0 also where their K or V is not finite.
                ds = gl.where(seen, ds, 0.0)
                _finite_keys(k_smem, stage, OWN, BN, D)
            ds_op = gl.convert_layout(ds.to(dtype), op_layout)
            slot = gl.where(masked, OWN, stage)
            dq = warpgroup_mma(ds_op, k_smem.index(slot).reshape([BN, D]), dq, is_async=True)
            dq, ds_op = warpgroup_mma_wait(0, deps=(dq, ds_op))
        else:
            mbarrier.wait(v_ready.index(stage), phase)
            mbarrier.arrive(v_empty.index(stage))
        mbarrier.arrive(k_empty.index(stage))

    # Every MMA that read q has completed: its buffer carries dq to the store layout.
    q.store((dq * sm_scale).to(dtype))
    gl.store(dq_ptr + offs, q.load(io_layout), mask=live)


@gluon.jit
def _causal_dq_producer(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, hk, n_tiles,
                        BN: gl.constexpr, NUM_STAGES: gl.constexpr):
    """TMA loads of the program's keys ``[0, n_tiles * BN)``, K and V tile by tile into the ring."""
    _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, hk, n_tiles, 0, n_tiles, 0,
             BN, NUM_STAGES)


@gluon.jit
def _attn_bwd_causal_dq_ws_kernel(q_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, k_desc, v_desc, Tq, Tk, Hq, NBH,
                                  qk_scale, sm_scale, G: gl.constexpr, BN: gl.constexpr, NUM_STAGES: gl.constexpr,
                                  CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """One program: 128 query rows of one (batch, query head), ``NBH = B * Hq``; the last row tiles (the most
    keys) first, (batch, head) fastest."""
    D: gl.constexpr = k_desc.block_type.shape[2]
    gl.static_assert((D == 64) or (D == 128), "head dim 64 or 128")
    gl.static_assert(k_desc.block_type.shape[1] == BN, "K boxes are BN keys")

    pid = gl.program_id(0)
    pid_bh = pid % NBH
    m_tile = gl.cdiv(Tq, 2 * _ROWS) - 1 - pid // NBH
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // G
    m0 = m_tile * (2 * _ROWS)
    n_tiles = gl.cdiv(gl.minimum(Tk, m0 + 2 * _ROWS), BN)

    row_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_ROWS, D], k_desc.dtype)
    q_smem = gl.allocate_shared_memory(k_desc.dtype, [2, _ROWS, D], row_layout)
    do_smem = gl.allocate_shared_memory(k_desc.dtype, [2, _ROWS, D], row_layout)
    # K: the ring's stages, then one slot per consumer for its masked tiles' finite copies.
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES + 2] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
    k_ready, k_empty, v_ready, v_empty, turn = _init_ring(NUM_STAGES)
    fence_async_shared()

    gl.warp_specialize([
        (_causal_dq_consumer, (q_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, q_smem, do_smem, k_smem, v_smem, k_ready,
                               k_empty, v_ready, v_empty, b, h, m0, Tq, Tk, Hq, n_tiles, qk_scale, sm_scale, 0, BN,
                               NUM_STAGES)),
        (_causal_dq_consumer, (q_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, q_smem, do_smem, k_smem, v_smem, k_ready,
                               k_empty, v_ready, v_empty, b, h, m0, Tq, Tk, Hq, n_tiles, qk_scale, sm_scale, 1, BN,
                               NUM_STAGES)),
        (_causal_dq_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, hk, n_tiles,
                               BN, NUM_STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ------------------------------------------------------------------------------------------------ launcher


def attention_bwd_gluon_sm90_causal(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    o: torch.Tensor, lse: torch.Tensor, scale: float, delta=None) -> tuple:
    """The backward of top-left causal attention (``block_sparse_attention`` with ``causal_block_mask``) on an
    sm_90 GPU: ``(dq, dk, dv)`` like q, k, v.

    q ``[B, Tq, Hq, D]``, k / v ``[B, Tk, Hkv, D]`` contiguous bf16 / fp16 with D in (64, 128), ``Hq`` a multiple
    of ``Hkv``, 16-byte aligned base addresses; ``o``, ``lse`` the forward's outputs (natural-log lse fp32
    ``[B, Hq, Tq]``), ``do`` the gradient of o; ``delta`` (fp32 ``[B, Hq, Tq]``, ``rowsum(o * do)``) when already
    computed, else the portable preprocess kernel computes it. Keys nobody sees (``j >= Tq``) get dk, dv 0.
    """
    from dflash_kernels.ops.attention.kernels import attention_bwd_preprocess_kernel

    assert q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9, "needs an sm_90 GPU"
    assert q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype and v.dtype == q.dtype, "bf16 / fp16"
    assert q.dim() == 4 and k.dim() == 4 and k.shape == v.shape
    B, Tq, Hq, D = q.shape
    Bk, Tk, Hkv, Dk = k.shape
    assert Bk == B and Dk == D and D in (64, 128) and Hkv > 0 and Hq % Hkv == 0
    assert o.shape == q.shape and do.shape == q.shape and lse.shape == (B, Hq, Tq)
    do = do.contiguous()
    for name, x in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do)):
        assert x.is_contiguous(), f"{name} must be contiguous"
        assert x.data_ptr() % 16 == 0, f"{name}: TMA needs a 16-byte aligned base address"
    dq = alloc.empty_like(q)
    dk = alloc.empty_like(k)
    dv = alloc.empty_like(v)
    if B == 0 or Tq == 0 or Tk == 0 or Hq == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    lse = lse.contiguous()
    if delta is None:
        delta = alloc.empty(B, Hq, Tq, dtype=torch.float32, device=q.device)
        attention_bwd_preprocess_kernel(
            lambda m: (cdiv(Tq, m["BT"]), B * Hq), o, do, delta, Tq, Hq,
            o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1), do.stride(2),
            bucket=(bucket(Tq), 1), D=D)
    delta = delta.contiguous()
    G = Hq // Hkv
    buckets = (bucket(Tq), bucket(Tk))

    cfg = dq_config(D)
    attention_bwd_gluon_causal_dq_kernel(
        (cdiv(Tq, BM_Q) * B * Hq, ), q, do, lse, delta, dq, descriptor(k, cfg["BN"]), descriptor(v, cfg["BN"]),
        Tq, Tk, Hq, B * Hq, scale * LOG2E, scale, bucket=buckets, G=G, BN=cfg["BN"], NUM_STAGES=cfg["NUM_STAGES"],
        CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS)

    cfg = dkdv_config(D)
    variant = _debug_variant()
    if variant.get("VARIANT", 0) & 16:  # debug: rank-4 [1, 64, 1, D] boxes (the DFlash kernel's, GH = 1)
        q_desc, do_desc = row_descriptor(q, ROWS, 1), row_descriptor(do, ROWS, 1)
    else:
        q_desc, do_desc = descriptor(q, ROWS), descriptor(do, ROWS)
    attention_bwd_gluon_causal_dkdv_kernel(
        (cdiv(Tk, BN_KV) * B * Hkv, ), q_desc, do_desc, descriptor(k, KH),
        descriptor(v, KH), dk, dv, lse, delta, Tq, Tk, Hq, Hkv, B * Hkv, scale * LOG2E, scale,
        bucket=buckets, G=G, NUM_STAGES=cfg["NUM_STAGES"], CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
        **variant)
    return dq, dk, dv


def _debug_variant() -> dict:
    """Diagnostic only (module docstring): ``DFLASH_CAUSAL_BWD_VARIANT`` (an int, bits of the dk / dv kernel's
    VARIANT) when set and non-zero, else nothing (the kernel's default 0)."""
    import os

    v = int(os.environ.get("DFLASH_CAUSAL_BWD_VARIANT", "0") or 0)
    return {"VARIANT": v} if v else {}


# Launched through the runtime's kernel cache with the forwards' one launch config (kernels_gluon_sm90.py).
attention_bwd_gluon_causal_dq_kernel = TritonKernel(_attn_bwd_causal_dq_ws_kernel,
                                                    name="block_sparse_attn_bwd_gluon_sm90_causal_dq",
                                                    configs=GLUON_CONFIGS)
attention_bwd_gluon_causal_dkdv_kernel = TritonKernel(_attn_bwd_causal_dkdv_ws_kernel,
                                                      name="block_sparse_attn_bwd_gluon_sm90_causal_dkdv",
                                                      configs=GLUON_CONFIGS)
