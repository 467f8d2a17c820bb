"""The chunked gated delta rule forward on sm_90 (Hopper): after the solve kernel (kernels_fwd.py) has found
each chunk's t_bad, G and A = (I + L)^-1, one warp-specialized Gluon kernel does the state scan, U and the output
of every chunk. Opt-in (``DFLASH_KERNELS_GDN_FWD=gluon``, ``gated_delta_rule._gluon_forward``).

Per program: one sequence, one value head and a block of BV value columns; per chunk (notation of kernels_fwd.py,
S0 the state at the chunk start):

    X  = diag(beta) (V - diag(exp(G)) K S0)          rows from t_bad on (and past the sequence) set to 0
    U  = A X                                          (= u - w S0: w and u are never formed)
    o  = scale (diag(exp(G)) Q S0 + tril(Q K^T * Gamma) U)
    S1 = exp(G_last) S0 + K^T (diag(exp(G_last - G)) U)

The portable forward forms w = A diag(beta exp(G)) K and u = A diag(beta) V in a kernel of their own and reads
them back in the scan; here U comes from A directly, one [BT, BT] x [BT, BV] product more on the chunk-to-chunk
chain, and the output's products leave that chain for a warpgroup of their own.

Partitions (``gl.warp_specialize``):

- the chain warpgroup (the default partition): S0 in fp32 registers. Each chunk it stores S0 in the input dtype
  to a shared slot (``h_smem``, two, alternating by chunk) that both warpgroups read, then K S0, X, U = A X (A
  from global memory into registers, the MMA's A operand), U to a shared slot (``u_smem``, two) for the output
  warpgroup, diag(exp(G_last - G)) U to one of its own, and S1. From a chunk with t_bad < BT on, S is NaN.
- the output warpgroup: P = Q K^T masked with Gamma, then Q S0 and P U from the chain's slots; o stored, NaN
  from the chunk's t_bad on.
- the producer warp: TMA copies of the chunk's q and k (its key head) and v (the value block) into a ring of
  NUM_STAGES stages, which both warpgroups release.

Barriers: ``ready`` / ``empty`` per ring stage (TMA bytes; two releases), and per slot ``h_ready`` / ``h_free``
and ``u_ready`` / ``u_free`` (one arrival each): the chain writes slot ``c % 2`` at chunk ``c`` once the output
warpgroup has released it from chunk ``c - 2``.

Non-finite inputs follow kernels_fwd.py's docstring: the rows from a chunk's t_bad on enter X as 0 (so U's rows
there are 0, A's rows being the identity's), o is NaN from t_bad on and the state after such a chunk is NaN.
K enters the output only through ``tril(Q K^T * Gamma)``, whose entries above the diagonal are selected, not
multiplied.

Rows past a sequence's end read as zeros (the TMA boxes are [1, BT, *] over ``[B, T, heads * D]`` views: a box
never crosses into the next sequence); their o is not stored. Fixed-length batches only (no ``cu_seqlens``).

``fused_fwd_reference`` is the same schedule in PyTorch, with the kernel's roundings: the CPU tests check it
against the portable forward, the GPU tests check the kernel against it.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from dflash_kernels.runtime import Config, TritonKernel, alloc, bucket, cdiv
from dflash_kernels.runtime.devices import device_index, sm_count
from dflash_kernels.runtime.tma import smem_layout

__all__ = ["gdn_fwd_gluon_sm90", "gdn_fwd_gluon_kernel", "gluon_forward_supports", "fused_fwd_reference"]

CHUNK = 64  # chunk length, as kernels_fwd.py
VBLOCK = 64  # value columns per program (BV, the v box's width): S0 [K, BV] fp32 is 64 registers a thread of the
# chain warpgroup at K = 128; 32 where 64 leaves SMs idle (``gdn_fwd_gluon_sm90``'s block_v)
STAGES = 2  # the q / k / v ring
BT: gl.constexpr = gl.constexpr(CHUNK)  # the same, as the kernels see them
NUM_STAGES: gl.constexpr = gl.constexpr(STAGES)
PRODUCER_REGS = 24
CONSUMER_REGS = 232
MAXNREG = 168  # the launch value, before setmaxnreg moves registers between the partitions (as the attention's)


def gluon_forward_supports(q, k, v, cu_seqlens, save_states: bool) -> bool:
    """Whether ``gdn_fwd_gluon_sm90`` takes these inputs: an sm_90 GPU, bf16 / fp16, K = 128, V a multiple of
    64, fixed-length sequences, no kept states, every TMA base and stride 16-byte aligned."""
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if q.shape[-1] != 128 or k.shape[-1] != 128 or v.shape[-1] % VBLOCK != 0:
        return False
    if cu_seqlens is not None or save_states:
        return False
    for x in (q, k, v):
        if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1] or x.data_ptr() % 16:
            return False
        if any((s * x.element_size()) % 16 for s in (x.stride(0), x.stride(1))):
            return False
    return True


@gluon.constexpr_function
def _acc_layout(N):
    """The fp32 accumulator layout of a warpgroup MMA with N columns (warps stacked along the rows)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])


@gluon.jit
def _beta(x, BETA_MODE: gl.constexpr):
    """beta from what was passed (fp32), as kernels_fwd.gdn_beta: as is, sigmoid, 2 * sigmoid."""
    if BETA_MODE == 1:
        x = 1.0 / (1.0 + gl.exp(-x))
    elif BETA_MODE == 2:
        x = 2.0 / (1.0 + gl.exp(-x))
    return x


@gluon.jit
def _chunk(c, T, b, h, gcum_ptr, t_bad_ptr, NT, HV: gl.constexpr, HAS_T_BAD: gl.constexpr, layout: gl.constexpr):
    """Chunk ``c`` as both warpgroups see it: its ring stage and phase, its S0 / U slot and that slot's phase, the
    rows' offsets inside the chunk, their token indices (into [B, T, HV] tensors, for value head ``h``), their
    validity, the rows read (valid, before t_bad), t_bad (BT when none) and G (0 past the sequence)."""
    o_i = gl.arange(0, BT, layout)
    rows = c * BT + o_i
    m_t = rows < T
    if HAS_T_BAD:
        t_bad = gl.load(t_bad_ptr + (b * NT + c) * HV + h)
    else:
        t_bad = BT
    tok = (b * T + rows).to(gl.int64) * HV + h
    G = gl.load(gcum_ptr + tok, mask=m_t, other=0.0)
    return (c % NUM_STAGES, (c // NUM_STAGES) & 1, c % 2, (c // 2) & 1, o_i, tok, m_t, m_t & (o_i < t_bad), t_bad,
            G)


@gluon.jit
def _chain(k_smem, v_smem, h_smem, u_smem, ud_smem, x_smem, ready, empty, h_ready, h_free, u_ready, u_free,
           A_ptr, gcum_ptr, beta_ptr, t_bad_ptr, h0_ptr, ht_ptr, b, h, vb, T, NT,
           HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, BETA_MODE: gl.constexpr,
           HAS_H0: gl.constexpr, HAS_T_BAD: gl.constexpr, STATE_V_FIRST: gl.constexpr):
    """The chain warpgroup: S0 -> S1 chunk after chunk, U into the output warpgroup's slots (module docstring)."""
    dtype: gl.constexpr = k_smem.dtype
    x_layout: gl.constexpr = _acc_layout(BV)  # [BT, BV] and [K, BV] accumulators
    rows_l: gl.constexpr = gl.SliceLayout(1, x_layout)
    a_dot: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=x_layout, k_width=2)
    a_blk: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])

    o_k = gl.arange(0, K, rows_l)
    o_v = vb * BV + gl.arange(0, BV, gl.SliceLayout(0, x_layout))
    state = (b * HV + h).to(gl.int64) * (K * V)
    if STATE_V_FIRST:
        p_state = gl.expand_dims(o_v, 0) * K + gl.expand_dims(o_k, 1)
    else:
        p_state = gl.expand_dims(o_k, 1) * V + gl.expand_dims(o_v, 0)
    if HAS_H0:
        S = gl.load(h0_ptr + state + p_state).to(gl.float32)
    else:
        S = gl.zeros([K, BV], gl.float32, x_layout)
    a_r = gl.arange(0, BT, gl.SliceLayout(1, a_blk))
    a_c = gl.arange(0, BT, gl.SliceLayout(0, a_blk))
    zero = gl.zeros([BT, BV], gl.float32, x_layout)
    for c in range(NT):
        stage, phase, buf, bphase, o_i, tok, m_t, f_t, t_bad, G = _chunk(c, T, b, h, gcum_ptr, t_bad_ptr, NT, HV,
                                                                         HAS_T_BAD, rows_l)
        last = gl.minimum(c * BT + BT, T) - 1
        G_last = gl.load(gcum_ptr + (b * T + last).to(gl.int64) * HV + h)
        beta = gl.where(f_t, _beta(gl.load(beta_ptr + tok, mask=f_t, other=0.0).to(gl.float32), BETA_MODE), 0.0)
        # A's rows of this chunk: fp32 in memory, the U product's A operand in registers.
        a_rows = c * BT + a_r
        a_tok = (b * T + a_rows).to(gl.int64) * HV + h
        a = gl.load(A_ptr + gl.expand_dims(a_tok * BT, 1) + gl.expand_dims(a_c, 0),
                    mask=gl.expand_dims(a_rows < T, 1), other=0.0)
        a = gl.convert_layout(a.to(dtype), a_dot)

        # S0 into slot buf, once the output warpgroup has released it (chunk c - 2).
        mbarrier.wait(h_free.index(buf), bphase ^ 1)
        h_buf = h_smem.index(buf)
        h_buf.store(S.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(h_ready.index(buf))

        mbarrier.wait(ready.index(stage), phase)
        k_tile = k_smem.index(stage).reshape([BT, K])
        ks = warpgroup_mma(k_tile, h_buf, zero, use_acc=False)
        vt = v_smem.index(stage).reshape([BT, BV]).load(x_layout).to(gl.float32)
        X = gl.expand_dims(beta, 1) * (vt - gl.expand_dims(gl.exp(G), 1) * ks)
        X = gl.where(gl.expand_dims(f_t, 1), X, 0.0)
        x_smem.store(X.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        U = warpgroup_mma(a, x_smem, zero, use_acc=False).to(dtype)

        mbarrier.wait(u_free.index(buf), bphase ^ 1)
        u_smem.index(buf).store(U)
        d = gl.where(m_t, gl.exp(G_last - G), 0.0)
        ud_smem.store((U.to(gl.float32) * gl.expand_dims(d, 1)).to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(u_ready.index(buf))

        S = warpgroup_mma(k_tile.permute((1, 0)), ud_smem, S * gl.exp(G_last))
        mbarrier.arrive(empty.index(stage))
        if HAS_T_BAD:
            S = gl.where(t_bad < BT, float("nan"), S)
    gl.store(ht_ptr + state + p_state, S)


@gluon.jit
def _output(q_smem, k_smem, h_smem, u_smem, ready, empty, h_ready, h_free, u_ready, u_free, o_ptr, gcum_ptr,
            t_bad_ptr, b, h, vb, T, NT, scale, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
            BV: gl.constexpr, HAS_T_BAD: gl.constexpr):
    """The output warpgroup: o of every chunk from Q, K and the chain's S0 and U (module docstring)."""
    dtype: gl.constexpr = q_smem.dtype
    x_layout: gl.constexpr = _acc_layout(BV)
    p_layout: gl.constexpr = _acc_layout(BT)
    rows_l: gl.constexpr = gl.SliceLayout(1, x_layout)
    p_dot: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=x_layout, k_width=2)
    o_v = vb * BV + gl.arange(0, BV, gl.SliceLayout(0, x_layout))
    p_cols = gl.arange(0, BT, gl.SliceLayout(0, p_layout))
    zero_p = gl.zeros([BT, BT], gl.float32, p_layout)
    zero_o = gl.zeros([BT, BV], gl.float32, x_layout)
    for c in range(NT):
        stage, phase, buf, bphase, o_i, tok, m_t, f_t, t_bad, G = _chunk(c, T, b, h, gcum_ptr, t_bad_ptr, NT, HV,
                                                                         HAS_T_BAD, rows_l)
        mbarrier.wait(ready.index(stage), phase)
        q_tile = q_smem.index(stage).reshape([BT, K])
        k_tile = k_smem.index(stage).reshape([BT, K])
        P = warpgroup_mma(q_tile, k_tile.permute((1, 0)), zero_p, use_acc=False)
        p_rows = gl.convert_layout(o_i, gl.SliceLayout(1, p_layout))
        G_r = gl.convert_layout(G, gl.SliceLayout(1, p_layout))
        G_c = gl.convert_layout(G, gl.SliceLayout(0, p_layout))
        m_r = gl.convert_layout(m_t, gl.SliceLayout(1, p_layout))
        causal = (gl.expand_dims(p_rows, 1) >= gl.expand_dims(p_cols, 0)) & gl.expand_dims(m_r, 1)
        gamma = gl.exp(gl.where(causal, gl.expand_dims(G_r, 1) - gl.expand_dims(G_c, 0), 0.0))
        P = gl.where(causal, P * gamma, 0.0)
        p = gl.convert_layout(P.to(dtype), p_dot)

        mbarrier.wait(h_ready.index(buf), bphase)
        O = warpgroup_mma(q_tile, h_smem.index(buf), zero_o, use_acc=False)
        mbarrier.arrive(h_free.index(buf))
        mbarrier.arrive(empty.index(stage))  # q and k read
        O = O * gl.expand_dims(gl.exp(G), 1)
        mbarrier.wait(u_ready.index(buf), bphase)
        O = warpgroup_mma(p, u_smem.index(buf), O)
        mbarrier.arrive(u_free.index(buf))
        if HAS_T_BAD:
            O = gl.where(gl.expand_dims(o_i < t_bad, 1), O, float("nan"))
        p_o = gl.expand_dims(tok * V, 1) + gl.expand_dims(o_v, 0)
        gl.store(o_ptr + p_o, (O * scale).to(dtype), mask=gl.expand_dims(m_t, 1))


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, ready, empty, b, h, hk, vb, NT,
              K: gl.constexpr, V: gl.constexpr):
    """TMA copies of each chunk's q, k and v block into the ring."""
    BV: gl.constexpr = v_desc.block_type.shape[2]
    nbytes: gl.constexpr = q_desc.block_type.nbytes + k_desc.block_type.nbytes + v_desc.block_type.nbytes
    for c in range(NT):
        stage = c % NUM_STAGES
        # The first pass over the ring waits for parity 1, which a fresh mbarrier has completed.
        mbarrier.wait(empty.index(stage), ((c // NUM_STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(stage), nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, c * BT, hk * K], ready.index(stage), q_smem.index(stage))
        tma.async_copy_global_to_shared(k_desc, [b, c * BT, hk * K], ready.index(stage), k_smem.index(stage))
        tma.async_copy_global_to_shared(v_desc, [b, c * BT, h * V + vb * BV], ready.index(stage),
                                        v_smem.index(stage))


@gluon.jit
def _gdn_fwd_ws_kernel(q_desc, k_desc, v_desc, o_ptr, A_ptr, gcum_ptr, beta_ptr, t_bad_ptr, h0_ptr, ht_ptr, T, NT,
                       scale, HK: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                       BETA_MODE: gl.constexpr, HAS_H0: gl.constexpr, HAS_T_BAD: gl.constexpr,
                       STATE_V_FIRST: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """One program: sequence ``b``, value head ``h``, value block ``vb``; grid ``B * HV * (V // BV)``, BV the v
    box's width."""
    BV: gl.constexpr = v_desc.block_type.shape[2]
    NVB: gl.constexpr = V // BV
    pid = gl.program_id(0)
    vb = pid % NVB
    h = (pid // NVB) % HV
    b = pid // (NVB * HV)
    hk = h // (HV // HK)
    dtype: gl.constexpr = q_desc.dtype

    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
    h_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([K, BV], dtype)
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BV], dtype)
    h_smem = gl.allocate_shared_memory(dtype, [2, K, BV], h_layout)
    u_smem = gl.allocate_shared_memory(dtype, [2, BT, BV], x_layout)
    ud_smem = gl.allocate_shared_memory(dtype, [BT, BV], x_layout)
    x_smem = gl.allocate_shared_memory(dtype, [BT, BV], x_layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # the chain and the output warpgroup
    h_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    h_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    u_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    u_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(h_ready.index(i), count=1)
        mbarrier.init(h_free.index(i), count=1)
        mbarrier.init(u_ready.index(i), count=1)
        mbarrier.init(u_free.index(i), count=1)
    # The ring's barriers are completed by TMA (the async proxy): make their initialisation visible to it.
    fence_async_shared()

    gl.warp_specialize([
        (_chain, (k_smem, v_smem, h_smem, u_smem, ud_smem, x_smem, ready, empty, h_ready, h_free, u_ready, u_free,
                  A_ptr, gcum_ptr, beta_ptr, t_bad_ptr, h0_ptr, ht_ptr, b, h, vb, T, NT, HV, K, V, BV, BETA_MODE,
                  HAS_H0, HAS_T_BAD, STATE_V_FIRST)),
        (_output, (q_smem, k_smem, h_smem, u_smem, ready, empty, h_ready, h_free, u_ready, u_free, o_ptr, gcum_ptr,
                   t_bad_ptr, b, h, vb, T, NT, scale, HV, K, V, BV, HAS_T_BAD)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, ready, empty, b, h, hk, vb, NT, K, V)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _descriptor(x: torch.Tensor, cols: int) -> TensorDescriptor:
    """A rank-3 TMA descriptor over ``[B, T, heads, D]`` (rows of ``heads * D`` elements, any 16-byte multiple
    row stride) viewed as ``[B, T, heads * D]``, with ``[1, BT, cols]`` boxes."""
    B, T, NH, D = x.shape
    block = [1, CHUNK, cols]
    return TensorDescriptor(x, [B, T, NH * D], [x.stride(0), x.stride(1), 1], block, smem_layout(block, x.dtype))


def gdn_fwd_gluon_sm90(q, k, v, beta, gcum, A, t_bad, h0, scale: float, beta_mode: int = 0,
                       state_v_first: bool = False, block_v: int = None):
    """The forward's scan, U and output (module docstring): ``(o [B, T, Hv, V] like q, final state fp32
    [B, Hv, K, V] or [B, Hv, V, K])``. q, k ``[B, T, Hk, 128]`` (l2-normalised when the op asks), v ``[B, T, Hv,
    V]`` (rows may be strided), beta ``[B, T, Hv]`` as passed (``beta_mode`` as kernels_fwd.gdn_beta), and the
    solve kernel's gcum ``[B, T, Hv]``, A ``[B, T, Hv, 64]`` fp32 and t_bad ``[B * chunks, Hv]`` int32 (or None);
    h0 fp32 in the final state's layout, or None. ``gluon_forward_supports`` must hold. ``block_v``: the value
    columns per program, 64 or 32 (default: 32 when 64 gives fewer programs than the GPU has SMs)."""
    assert gluon_forward_supports(q, k, v, None, False), "gdn_fwd_gluon_sm90: inputs it does not take"
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    assert Hv % Hk == 0 and beta.is_contiguous() and gcum.is_contiguous() and A.is_contiguous()
    if block_v is None:
        block_v = 32 if B * Hv * (V // VBLOCK) < sm_count(device_index(q.device)) else VBLOCK
    assert block_v in (32, 64) and V % block_v == 0, f"block_v: 32 or 64, dividing V = {V}; got {block_v}"
    NT = cdiv(T, CHUNK)
    o = alloc.empty(B, T, Hv, V, dtype=q.dtype, device=q.device)
    ht = alloc.empty(B, Hv, *((V, K) if state_v_first else (K, V)), dtype=torch.float32, device=q.device)
    if T == 0 or B * Hv == 0:
        if h0 is not None:
            ht.copy_(h0)
        else:
            ht.zero_()
        return o, ht
    if h0 is not None:
        h0 = h0.contiguous()
    gdn_fwd_gluon_kernel(
        (B * Hv * (V // block_v),), _descriptor(q, K), _descriptor(k, K), _descriptor(v, block_v), o, A, gcum, beta,
        t_bad, h0, ht, T, NT, scale, bucket=(bucket(T),), HK=Hk, HV=Hv, K=K, V=V, BETA_MODE=beta_mode,
        HAS_H0=h0 is not None, HAS_T_BAD=t_bad is not None, STATE_V_FIRST=bool(state_v_first),
        CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS)
    return o, ht


# One launch configuration: the tiles are fixed (BT; BV by the v descriptor) and the register split is part of the
# design.
gdn_fwd_gluon_kernel = TritonKernel(_gdn_fwd_ws_kernel, name="gdn_fwd_gluon_sm90",
                                    configs=[Config(num_warps=4, num_stages=1, maxnreg=MAXNREG)])


def fused_fwd_reference(q, k, v, beta, gcum, A, t_bad, h0, scale: float, beta_mode: int = 0):
    """The kernel's schedule in PyTorch, with its roundings (S0, X, U and diag(exp(G_last - G)) U in the input
    dtype, products accumulated in fp32): ``(o, final state [B, Hv, K, V] fp32)``. Any K and V; the inputs as
    ``gdn_fwd_gluon_sm90`` takes them (t_bad, h0 may be None). For the tests: it runs on any device."""
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    dt = q.dtype
    G_heads = Hv // Hk
    f32 = torch.float32
    # [B, Hv, T, D] views, key heads repeated for their value heads
    qh = q.to(f32).repeat_interleave(G_heads, dim=2).transpose(1, 2)
    kh = k.to(f32).repeat_interleave(G_heads, dim=2).transpose(1, 2)
    vh = v.to(f32).transpose(1, 2)
    Gh = gcum.to(f32).transpose(1, 2)
    bh = beta.to(f32).transpose(1, 2)
    if beta_mode == 1:
        bh = torch.sigmoid(bh)
    elif beta_mode == 2:
        bh = 2 * torch.sigmoid(bh)
    Ah = A.to(f32).transpose(1, 2)  # [B, Hv, T, BT]
    NT = cdiv(T, CHUNK)
    S = torch.zeros(B, Hv, K, V, dtype=f32, device=q.device) if h0 is None else h0.to(f32).clone()
    o = torch.empty(B, T, Hv, V, dtype=dt, device=q.device)
    ar = torch.arange(CHUNK, device=q.device)
    rnd = lambda x: x.to(dt).to(f32)  # noqa: E731 - a value as the kernel holds it in the input dtype
    zero = torch.zeros((), dtype=f32, device=q.device)
    for c in range(NT):
        lo, hi = c * CHUNK, min(c * CHUNK + CHUNK, T)
        n = hi - lo
        tb = (t_bad.view(B, NT, Hv)[:, c].to(torch.long) if t_bad is not None
              else torch.full((B, Hv), CHUNK, dtype=torch.long, device=q.device))  # [B, Hv]
        read = (ar[:n].view(1, 1, n) < tb.unsqueeze(-1)).unsqueeze(-1)  # [B, Hv, n, 1]: rows before t_bad
        Qc, Kc, Vc = qh[:, :, lo:hi], kh[:, :, lo:hi], vh[:, :, lo:hi]
        G, G_last = Gh[:, :, lo:hi].unsqueeze(-1), Gh[:, :, hi - 1:hi].unsqueeze(-1)  # [B, Hv, n, 1], [B, Hv, 1, 1]
        Sd = rnd(S)
        X = torch.where(read, torch.where(read, bh[:, :, lo:hi].unsqueeze(-1), zero) * (Vc - G.exp() * (Kc @ Sd)),
                        zero)
        U = rnd(rnd(Ah[:, :, lo:hi, :n]) @ rnd(X))
        causal = ar[:n].view(n, 1) >= ar[:n].view(1, n)
        gamma = torch.where(causal, G - G.transpose(-1, -2), zero).exp()
        P = torch.where(causal, (Qc @ Kc.transpose(-1, -2)) * gamma, zero)
        O = torch.where(read, (Qc @ Sd) * G.exp() + rnd(P) @ U, float("nan"))
        o[:, lo:hi] = (O * scale).to(dt).transpose(1, 2)
        S = S * G_last.exp() + Kc.transpose(-1, -2) @ rnd(U * (G_last - G).exp())
        S = torch.where((tb < CHUNK).view(B, Hv, 1, 1), float("nan"), S)
    return o, S
