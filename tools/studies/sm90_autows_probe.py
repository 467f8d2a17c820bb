"""Does Triton's automatic warp specialization (``tl.range(..., warp_specialize=True)``) split an attention
loop into producer and consumer partitions on sm_90? Compiled for Hopper on the CPU (no GPU needed).

    python -m tools.studies.sm90_autows_probe

The kernel is a plain flash-attention forward over one [N, D] key/value sequence: K and V through in-kernel TMA
descriptors, ``BM`` query rows, a ``BN``-key loop with the online softmax, bf16, D = 128. It is compiled with
and without ``warp_specialize`` at 4 and 8 warps. Per build the script prints the shared memory, registers and
spills (``sm90_resources.compile_resources``), how many ``ttg.warp_specialize`` ops (the partitions the pass
creates) the TTGIR holds, and the ``setmaxnreg`` and ``wgmma.mma_async`` instructions of the PTX; a build the
compiler rejects prints its error. Run without TRITON_INTERPRET.
"""

import os
import sys

import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
from tools.studies.sm90_resources import compile_resources  # noqa: E402


@triton.jit
def _probe_attention(q_ptr, k_ptr, v_ptr, o_ptr, N, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                     WS: tl.constexpr):
    o_m = tl.program_id(0) * BM + tl.arange(0, BM)
    o_d = tl.arange(0, D)
    q = tl.load(q_ptr + o_m[:, None] * D + o_d[None, :])
    k_desc = tl.make_tensor_descriptor(k_ptr, shape=[N, D], strides=[D, 1], block_shape=[BN, D])
    v_desc = tl.make_tensor_descriptor(v_ptr, shape=[N, D], strides=[D, 1], block_shape=[BN, D])
    m_i = tl.full([BM], -float("inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for start in tl.range(0, N, BN, num_stages=2, warp_specialize=WS):
        s = tl.dot(q, k_desc.load([start, 0]).T)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(tl.bfloat16), v_desc.load([start, 0]), acc * alpha[:, None])
        m_i = m_new
    tl.store(o_ptr + o_m[:, None] * D + o_d[None, :], (acc / l_i[:, None]).to(tl.bfloat16))


def main():
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("sm90_autows_probe: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16", "N": "i32"}
    consts = dict(BM=128, BN=128, D=128)
    print(f"triton {triton.__version__}, sm_90, {consts}")
    for ws in (False, True):
        for warps in (4, 8):
            try:
                res = compile_resources(_probe_attention, types, {**consts, "WS": ws}, warps, 2)
                sig = {**{p: types.get(p, "constexpr") for p in ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "N")},
                       **{p: "constexpr" for p in (*consts, "WS")}}
                built = triton.compile(ASTSource(_probe_attention, sig, constexprs={**consts, "WS": ws}),
                                       target=GPUTarget("cuda", 90, 32),
                                       options={"num_warps": warps, "num_stages": 2})
                ttgir, ptx = built.asm["ttgir"], built.asm["ptx"]
                print(f"warp_specialize={ws!s:5} warps={warps}: {res}, ttg.warp_specialize ops "
                      f"{ttgir.count('ttg.warp_specialize')}, setmaxnreg {ptx.count('setmaxnreg')}, "
                      f"wgmma.mma_async {ptx.count('wgmma.mma_async')}", flush=True)
            except Exception as e:  # noqa: BLE001 - a rejected build is the finding, printed
                print(f"warp_specialize={ws!s:5} warps={warps}: does not compile "
                      f"({type(e).__name__}: {str(e).splitlines()[0][:120]})", flush=True)


if __name__ == "__main__":
    main()
