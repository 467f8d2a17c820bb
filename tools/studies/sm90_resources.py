"""Shared memory, registers and register spills of the library's tuning candidates on sm_90, without a GPU.

    python -m tools.studies.sm90_resources [attention|attention_sm90|gdn|gdn_prepare|conv ...]

Each candidate config of a kernel is compiled for Hopper (sm_90) with Triton's own toolchain
(ptxas, cuobjdump ship with the triton wheel) at the DFlash training step's shapes (each ``*_cases``
function says which), and one line per config reports the shared memory the launch needs (sm_90 allows
232,448 bytes per block), the registers per thread, the local-memory stack, how many spill stores/loads
(STL/LDL) the machine code holds, and how many of those lie inside its innermost loops (where they cost every
iteration). A candidate that spills in a hot loop is rarely the fastest; one that needs more shared memory
than the chip has is skipped by the tuner. No GPU is needed: check candidates here before timing them on one.

Run without TRITON_INTERPRET (interpreted kernels cannot be compiled); ``compile_resources`` is also
what the tests use to check that candidates fit the chip.
"""

import argparse
import inspect
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

H200_SHARED_MEMORY = 232448  # bytes per block, as Triton reports sm_90's (Hopper's) limit


def compile_resources(fn, arg_types: dict, constexprs: dict, num_warps: int, num_stages: int,
                      machine_code: bool = True) -> dict:
    """Compile the ``@triton.jit`` function ``fn`` for sm_90: ``{"shared", "regs", "stack", "stl", "ldl"}``
    (only ``shared`` when ``machine_code`` is False). ``arg_types``: Triton type strings of the runtime
    parameters ("*bf16", "*fp32", "fp32", ...); any not listed is "i32"."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = inspect.signature(fn.fn).parameters
    # Constexpr parameters left out take their defaults, as a launch does (else they would compile as
    # runtime integers, their `if`s as runtime branches: spills that the real kernel does not have).
    constexprs = {**{p: v.default for p, v in params.items()
                     if p not in constexprs and v.default is not inspect.Parameter.empty
                     and "constexpr" in str(v.annotation)}, **constexprs}
    sig = {p: "constexpr" if p in constexprs else arg_types.get(p, "i32") for p in params}
    # Pointers 16-byte aligned, as the runtime's launches specialize them (torch allocations are): the
    # compiler then vectorizes loads, which changes register counts a lot.
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
    compiled = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    out = {"shared": compiled.metadata.shared}
    if not machine_code:
        return out
    out.update(cubin_resources(compiled.asm["cubin"]))
    return out


def cubin_resources(cubin: bytes) -> dict:
    """Registers per thread, local-memory stack and spill stores / loads (STL / LDL in the SASS) of a compiled
    kernel's cubin, read with the cuobjdump that ships with Triton: ``{"regs", "stack", "stl", "ldl"}``."""
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    fields = dict(item.split(":") for item in usage.split() if ":" in item and item.split(":")[1].isdigit())
    return dict(regs=int(fields.get("REG", -1)), stack=int(fields.get("STACK", -1)), stl=sass.count("STL"),
                ldl=sass.count("LDL"), inner=inner_loop_spills(sass))


def inner_loop_spills(sass: str) -> int:
    """Spill stores and loads (STL / LDL) inside the innermost loops of the SASS (a loop: the instructions from a
    backward branch's target to the branch; innermost: holding no other): where a spill costs every iteration."""
    import re

    code = []  # (address, instruction)
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            code.append((int(m.group(1), 16), m.group(2)))
    loops = []
    for address, text in code:
        m = re.search(r"BRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < address:
            loops.append((int(m.group(1), 16), address))
    inner = [(a, b) for a, b in loops if not any((c, d) != (a, b) and a <= c and d <= b for c, d in loops)]
    return sum(1 for address, text in code if re.search(r"\b(STL|LDL)\b", text)
               and any(a <= address <= b for a, b in inner))


def _types(params, fp32=(), i32=(), u8=(), scalars_fp32=()):
    t = {}
    for p in params:
        if p in fp32:
            t[p] = "*fp32"
        elif p in i32:
            t[p] = "*i32"
        elif p in u8:
            t[p] = "*u8"
        elif p in scalars_fp32:
            t[p] = "fp32"
        elif p.endswith("_ptr") or p in ("q", "k", "v", "o", "do", "dq", "dk", "dv"):
            t[p] = "*bf16"
    return t


def attention_cases():
    """DFlash training mask: block 16, 4 query heads per kv head, D = 128, bf16; kv_tile 64."""
    from dflash_kernels.ops.attention import kernels as K
    base = dict(D=128, G=4, GH=4, BQ=16, BM=64, TW=1, HAS_TILES=False, DOT_PREC="tf32")
    for name, kern, extra in [("attn_fwd", K.attention_fwd_kernel, {}), ("attn_bwd_dq", K.attention_bwd_dq_kernel, {}),
                              ("attn_bwd_dkdv", K.attention_bwd_dkdv_kernel, {"KVT": 64})]:
        params = inspect.signature(kern.fn.fn).parameters
        types = _types(params, fp32=("lse", "delta"), i32=("segments", "seg_count", "rev_offsets", "rev_full",
                                                             "rev_entries"), u8=("tiles",),
                       scalars_fp32=("qk_scale", "sm_scale"))
        for c in kern.configs:
            yield name, kern.fn, types, {**base, **extra, **c.meta}, c


def attention_sm90_cases():
    """The Hopper forward (kernels_sm90.py) at the DFlash training mask: block 16, 4 query heads per kv head,
    bf16, D = 128 and D = 64 (BM = 64 rows: 16 positions x 4 heads)."""
    from dflash_kernels.ops.attention import kernels_sm90 as K
    kern = K.block_sparse_attn_fwd_sm90
    params = inspect.signature(kern.fn.fn).parameters
    types = _types(params, fp32=("lse",), i32=("segments", "seg_count"), u8=("tiles",), scalars_fp32=("qk_scale",))
    for D in (128, 64):
        base = dict(D=D, G=4, GH=4, BQ=16, BM=64, TW=1, HAS_TILES=False, DOT_PREC="tf32")
        for c in kern.configs:
            yield f"attn_fwd_sm90 D{D}", kern.fn, types, {**base, **c.meta}, c


def gdn_cases():
    """Qwen3.5 GDN: Hk = 16, Hv = 48, K = V = 128, bf16, chunk 64."""
    from dflash_kernels.ops.gated_delta_rule import kernels_bwd as KB
    from dflash_kernels.ops.gated_delta_rule import kernels_fwd as KF
    fp32 = ("gcum_ptr", "A_ptr", "h0_ptr", "ht_ptr", "dht_ptr", "dh0_ptr", "g_ptr", "dq_ptr", "dk_ptr",
            "dbeta_ptr", "dg_ptr")
    i32 = ("cu_seqlens_ptr", "chunk_indices_ptr", "chunk_offsets_ptr", "t_bad_ptr")
    common = dict(HK=16, HV=48, K=128, BT=64, BK=128, IS_VARLEN=False)
    for name, kern, extra in [
        ("gdn_fwd_solve", KF.gdn_fwd_solve_kernel.default, {"V": 128}),
        ("gdn_fwd_wu", KF.gdn_fwd_wu_kernel.default, {"V": 128, "HAS_T_BAD": True}),
        ("gdn_fwd_state", KF.gdn_fwd_scan_states_kernel.default, {"V": 128, "HAS_H0": False, "OUTPUT": False}),
        ("gdn_fwd_state_output", KF.gdn_fwd_scan_kernel.default,
         {"V": 128, "HAS_H0": False, "OUTPUT": True, "HAS_T_BAD": True}),
        ("gdn_bwd_state", KB.gdn_bwd_state_kernel.default, {"V": 128, "HAS_DHT": False, "HAS_H0": False}),
        ("gdn_bwd_local", KB.gdn_bwd_local_kernel.default, {"V": 128}),
        ("gdn_bwd_onepass", KB.gdn_bwd_onepass_kernel.default, {"V": 128}),
        # the group form at GQA 3 with the l2norm backward: dq and dk in bf16 ([B, T, Hk, K])
        ("gdn_bwd_group", KB.gdn_bwd_group_kernel.default, {"V": 128, "GROUP": True, "L2NORM": True}),
    ]:
        out32 = fp32 if not extra.get("GROUP") else tuple(p for p in fp32 if p not in ("dq_ptr", "dk_ptr"))
        types = _types(inspect.signature(kern.fn.fn).parameters, fp32=out32 + ("q_rstd_ptr", "k_rstd_ptr"), i32=i32,
                       scalars_fp32=("scale",))
        for c in kern.configs:
            meta = {k: v for k, v in {**common, **extra, **c.meta}.items() if v is not None}
            yield name, kern.fn, types, meta, c


def gdn_prepare_cases():
    """The GDN forward's fused solve and w/u kernel (kernels_fwd_fused.py, ``DFLASH_KERNELS_GDN_FWD_PREPARE=fused``),
    both candidate lists, beside the split path's two kernels at the same shape: Qwen3.5 GDN (Hk = 16, Hv = 48,
    K = V = 128, chunk 64), bf16 (and fp32) k, v and beta, fp32 g; plain gate and beta, then the raw gate with
    dt_bias and beta logits (the fused kernel's heaviest form)."""
    from dflash_kernels.ops.gated_delta_rule import kernels_fwd as KF
    from dflash_kernels.ops.gated_delta_rule import kernels_fwd_fused as KFF
    i32 = ("cu_seqlens_ptr", "chunk_indices_ptr", "t_bad_ptr")
    common = dict(HK=16, HV=48, K=128, V=128, BT=64, BK=128, IS_VARLEN=False)
    gate = dict(GATE=True, HAS_DT_BIAS=True, BETA_MODE=1)
    for name, kern, extra in [
        ("gdn_fwd_solve", KF.gdn_fwd_solve_kernel.default, {}),
        ("gdn_fwd_wu", KF.gdn_fwd_wu_kernel.default, {"HAS_T_BAD": True}),
        ("gdn_fwd_prepare", KFF.gdn_fwd_prepare_kernel.default, {}),
        ("gdn_fwd_prepare gate", KFF.gdn_fwd_prepare_kernel.default, gate),
        ("gdn_fwd_prepare_fp32", KFF.gdn_fwd_prepare_kernel.fp32, {}),
    ]:
        # A_log, dt_bias and g fp32 (as the op passes them), the rest in the list's dtype
        fp32 = ("gcum_ptr", "A_ptr", "g_ptr", "A_log_ptr", "dt_bias_ptr")
        if name.endswith("fp32"):
            fp32 += ("k_ptr", "v_ptr", "beta_ptr", "w_ptr", "u_ptr")
        types = _types(inspect.signature(kern.fn.fn).parameters, fp32=fp32, i32=i32)
        for c in kern.configs:
            yield name, kern.fn, types, {**common, **extra, **c.meta}, c


def conv_cases():
    """Causal conv1d, width 4, SiLU, bias, bf16, channel-first with 16-byte aligned rows."""
    from dflash_kernels.ops.conv1d import kernels as C
    common = dict(W=4, HAS_BIAS=True, HAS_SEQ=False, HAS_INIT=False, ACT=True, CHANNEL_LAST=False, ALIGNED=True)
    for name, kern, extra in [("conv_fwd", C.conv1d_fwd_kernel, {"HAS_FINAL": False}),
                              ("conv_bwd", C.conv1d_bwd_kernel, {"HAS_DFINAL": False})]:
        types = _types(inspect.signature(kern.fn.fn).parameters, fp32=("dw_ptr", "db_ptr"), i32=("seq_ptr",))
        for c in kern.configs:
            yield name, kern.fn, types, {**common, **extra, **c.meta}, c


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ops", nargs="*", default=["attention", "gdn", "conv"],
                        help="attention, attention_sm90 (the Hopper forward), gdn, gdn_prepare (the forward's fused "
                             "solve and w/u beside the split path's two kernels) and/or conv")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("sm90_resources: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")
    cases = {"attention": attention_cases, "attention_sm90": attention_sm90_cases, "gdn": gdn_cases,
             "gdn_prepare": gdn_prepare_cases, "conv": conv_cases}
    for op in args.ops:
        if op not in cases:
            raise SystemExit(f"sm90_resources: unknown op {op!r}; choose from {sorted(cases)}")
        for name, fn, types, consts, config in cases[op]():
            try:
                r = compile_resources(fn, types, consts, config.num_warps, config.num_stages)
            except Exception as e:  # noqa: BLE001 - a candidate that does not compile is a line, not a crash
                print(f"{name:16s} {config}: does not compile ({type(e).__name__}: {str(e).splitlines()[0][:80]})")
                continue
            fits = "fits" if r["shared"] <= H200_SHARED_MEMORY else "TOO MUCH SHARED MEMORY"
            print(f"{name:16s} {config}: shared {r['shared']:>6} B ({fits}), {r['regs']} regs, "
                  f"stack {r['stack']} B, spill stores {r['stl']}, loads {r['ldl']}, {r['inner']} in inner loops",
                  flush=True)


if __name__ == "__main__":
    main()
