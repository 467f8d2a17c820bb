"""Compile the warp-specialized Gluon attention kernels for sm_90 on the CPU: the dense forward
(kernels_gluon_sm90.py), the DFlash-mask forward (kernels_gluon_sm90_dflash.py), the DFlash-mask backward's
dk / dv and dq kernels (kernels_gluon_sm90_dflash_bwd.py) and the dense causal backward's dk / dv and dq kernels
(kernels_gluon_sm90_causal_bwd.py, GQA 1 and 4), the backwards at D = 128 and 64, bf16 and fp16; and the Gluon GDN
forward (ops/gated_delta_rule/kernels_gluon_sm90_fwd.py) at K = 128, V = 128 and 64, bf16 and fp16.

    python -m tools.studies.gluon_sm90_compile [--dump DIR]

Builds D = 64 and 128, bf16, with the launchers' tile config and launch options: dense causal and not, and
DFlash at GQA 4 with 16-position groups (64 live rows per consumer; the other GQA ratios change only
constants of the row arithmetic), through
Triton's own toolchain (ptxas and cuobjdump ship with the wheel; no GPU). Per build one line: the shared
memory the launch needs (sm_90 allows 232,448 bytes per block), registers per thread (the launch value:
``setmaxnreg`` moves them between the partitions afterwards), the local-memory stack and the spill stores /
loads of the SASS, then counts from the PTX that show the structure: ``wgmma.mma_async`` instructions (the
warpgroup MMAs), ``cp.async.bulk.tensor`` (TMA copies: loads and the o store), ``mbarrier`` operations, and
``setmaxnreg`` (the partitions' register budgets). The TTGIR's ``ttg.warp_specialize`` count is the number
of warp-specialized regions. ``--dump DIR`` writes each build's TTGIR and PTX there.

Run without TRITON_INTERPRET: interpreted kernels cannot be compiled.
"""

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

from tools.studies.sm90_resources import H200_SHARED_MEMORY, cubin_resources  # noqa: E402


def compile_gluon_attention(D: int, causal: bool, dtype=None):
    """The compiled kernel (``triton.compile``'s result) for head dim ``D``, as the launcher would launch it
    at bf16 (or ``dtype``). The descriptors' types are those of the launcher's own descriptors over
    placeholder CPU tensors (a type string holds the block shape and shared layout, not the address)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from dflash_kernels.ops.attention import kernels_gluon_sm90 as G

    dtype = dtype or torch.bfloat16
    cfg = G.tile_config(D)
    x = torch.empty(1, cfg["BN"], 2, D, dtype=dtype)
    q_desc, kv_desc = G.descriptor(x, G.BMW), G.descriptor(x, cfg["BN"])
    fn = G._attention_fwd_ws_kernel
    sig = {"q_desc": mangle_type(q_desc), "k_desc": mangle_type(kv_desc), "v_desc": mangle_type(kv_desc),
           "o_desc": mangle_type(q_desc), "lse_ptr": "*fp32", "B": "i32", "Lq": "i32", "Lk": "i32", "H": "i32",
           "GROUP": "i32", "qk_scale": "fp32"}
    constexprs = {"BN": cfg["BN"], "NUM_STAGES": cfg["NUM_STAGES"], "CAUSAL": causal,
                  "CONSUMER_REGS": G.CONSUMER_REGS, "PRODUCER_REGS": G.PRODUCER_REGS}
    sig.update({name: "constexpr" for name in constexprs})
    assert list(sig) == fn.arg_names, (list(sig), fn.arg_names)
    attrs = {(list(sig).index("lse_ptr"), ): [["tt.divisibility", 16]]}
    return triton.compile(GluonASTSource(fn, sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": G.MAXNREG})


def compile_gluon_dflash(D: int, G: int = 4, q_block: int = 16, dtype=None):
    """The compiled DFlash-mask kernel for head dim ``D``, GQA group ``G`` and ``q_block``-position groups,
    as its launcher would launch it at bf16 (or ``dtype``)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from dflash_kernels.ops.attention import kernels_gluon_sm90 as G_
    from dflash_kernels.ops.attention import kernels_gluon_sm90_dflash as GD

    dtype = dtype or torch.bfloat16
    cfg = G_.tile_config(D)
    x = torch.empty(1, cfg["BN"], 2, D, dtype=dtype)
    kv_desc = G_.descriptor(x, cfg["BN"])
    ptr = {torch.bfloat16: "*bf16", torch.float16: "*fp16"}[dtype]
    fn = GD._attn_fwd_dflash_ws_kernel
    sig = {"q_ptr": ptr, "k_desc": mangle_type(kv_desc), "v_desc": mangle_type(kv_desc), "o_ptr": ptr,
           "lse_ptr": "*fp32", "segments": "*i32", "seg_count": "*i32", "Tq": "i32", "NG": "i32", "MS": "i32",
           "MB": "i32", "Hq": "i32", "Hkv": "i32", "NBH": "i32", "qk_scale": "fp32"}
    constexprs = {"G": G, "BQ": q_block, "GH": GD.gluon_dflash_rows(q_block, G), "BN": cfg["BN"],
                  "NUM_STAGES": cfg["NUM_STAGES"], "CONSUMER_REGS": G_.CONSUMER_REGS,
                  "PRODUCER_REGS": G_.PRODUCER_REGS}
    sig.update({name: "constexpr" for name in constexprs})
    assert list(sig) == fn.arg_names, (list(sig), fn.arg_names)
    # The launcher's tensors are torch allocations (16-byte aligned); D and Hq * D make the row offsets
    # multiples of 8 elements.
    attrs = {(list(sig).index(n), ): [["tt.divisibility", 16]] for n in ("q_ptr", "o_ptr", "lse_ptr", "segments",
                                                                          "seg_count")}
    return triton.compile(GluonASTSource(fn, sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": G_.MAXNREG})


def compile_gluon_dflash_bwd(D: int, kernel: str, G: int = 4, q_block: int = 16, dtype=None):
    """The compiled DFlash-mask backward kernel ``kernel`` (``"dkdv"`` or ``"dq"``,
    kernels_gluon_sm90_dflash_bwd.py) for head dim ``D``, GQA group ``G`` and ``q_block``-position groups, as
    its launcher would launch it at bf16 (or ``dtype``)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from dflash_kernels.ops.attention import kernels_gluon_sm90 as G_
    from dflash_kernels.ops.attention import kernels_gluon_sm90_dflash as GD
    from dflash_kernels.ops.attention import kernels_gluon_sm90_dflash_bwd as GB

    dtype = dtype or torch.bfloat16
    ptr = {torch.bfloat16: "*bf16", torch.float16: "*fp16"}[dtype]
    GH = GD.gluon_dflash_rows(q_block, G)
    opts = {"num_warps": 4, "maxnreg": G_.MAXNREG}
    if kernel == "dkdv":
        cfg = GB.dkdv_config(D)
        x = torch.empty(1, q_block, G, D, dtype=dtype)
        row_desc = GB.row_descriptor(x, q_block, GH)
        kv_desc = G_.descriptor(torch.empty(1, GB.KH, 2, D, dtype=dtype), GB.KH)
        fn = GB._attn_bwd_dkdv_ws_kernel
        sig = {"q_desc": mangle_type(row_desc), "do_desc": mangle_type(row_desc), "k_desc": mangle_type(kv_desc),
               "v_desc": mangle_type(kv_desc), "dk_ptr": ptr, "dv_ptr": ptr, "lse_ptr": "*fp32",
               "delta_ptr": "*fp32", "segments": "*i32", "rev_offsets": "*i32", "rev_full": "*i32",
               "rev_entries": "*i32", "Tq": "i32", "Tk": "i32", "NG": "i32", "MS": "i32", "MB": "i32", "NKV": "i32",
               "Hq": "i32", "Hkv": "i32", "NBH": "i32", "qk_scale": "fp32", "sm_scale": "fp32"}
        constexprs = {"G": G, "NUM_STAGES": cfg["NUM_STAGES"], "CONSUMER_REGS": G_.CONSUMER_REGS,
                      "PRODUCER_REGS": G_.PRODUCER_REGS}
        aligned = ("dk_ptr", "dv_ptr", "lse_ptr", "delta_ptr", "segments", "rev_offsets", "rev_full", "rev_entries")
    else:
        cfg = GB.dq_config(D)
        kv_desc = G_.descriptor(torch.empty(1, cfg["BN"], 2, D, dtype=dtype), cfg["BN"])
        fn = GB._attn_bwd_dq_ws_kernel
        sig = {"q_ptr": ptr, "do_ptr": ptr, "lse_ptr": "*fp32", "delta_ptr": "*fp32", "dq_ptr": ptr,
               "k_desc": mangle_type(kv_desc), "v_desc": mangle_type(kv_desc), "segments": "*i32",
               "seg_count": "*i32", "Tq": "i32", "NG": "i32", "MS": "i32", "MB": "i32", "Hq": "i32", "Hkv": "i32",
               "NBH": "i32", "qk_scale": "fp32", "sm_scale": "fp32"}
        constexprs = {"G": G, "BQ": q_block, "GH": GH, "BN": cfg["BN"], "NUM_STAGES": cfg["NUM_STAGES"],
                      "CONSUMER_REGS": G_.CONSUMER_REGS, "PRODUCER_REGS": G_.PRODUCER_REGS}
        aligned = ("q_ptr", "do_ptr", "lse_ptr", "delta_ptr", "dq_ptr", "segments", "seg_count")
    sig.update({name: "constexpr" for name in constexprs})
    assert list(sig) == fn.arg_names, (list(sig), fn.arg_names)
    attrs = {(list(sig).index(n), ): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(GluonASTSource(fn, sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=opts)


def compile_gluon_causal_bwd(D: int, kernel: str, G: int = 4, dtype=None):
    """The compiled dense causal backward kernel ``kernel`` (``"dkdv"`` or ``"dq"``,
    kernels_gluon_sm90_causal_bwd.py) for head dim ``D`` and GQA group ``G``, as its launcher would launch it at
    bf16 (or ``dtype``)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from dflash_kernels.ops.attention import kernels_gluon_sm90 as G_
    from dflash_kernels.ops.attention import kernels_gluon_sm90_causal_bwd as GC

    dtype = dtype or torch.bfloat16
    ptr = {torch.bfloat16: "*bf16", torch.float16: "*fp16"}[dtype]
    opts = {"num_warps": 4, "maxnreg": G_.MAXNREG}
    if kernel == "dkdv":
        cfg = GC.dkdv_config(D)
        if GC._debug_variant().get("VARIANT", 0) & 16:  # debug variant: rank-4 [1, 64, 1, D] boxes
            row_desc = GC.row_descriptor(torch.empty(1, GC.ROWS, G, D, dtype=dtype), GC.ROWS, 1)
        else:
            row_desc = G_.descriptor(torch.empty(1, GC.ROWS, G, D, dtype=dtype), GC.ROWS)
        kv_desc = G_.descriptor(torch.empty(1, GC.KH, 2, D, dtype=dtype), GC.KH)
        fn = GC._attn_bwd_causal_dkdv_ws_kernel
        sig = {"q_desc": mangle_type(row_desc), "do_desc": mangle_type(row_desc), "k_desc": mangle_type(kv_desc),
               "v_desc": mangle_type(kv_desc), "dk_ptr": ptr, "dv_ptr": ptr,
               "lse_ptr": "*fp32", "delta_ptr": "*fp32", "Tq": "i32", "Tk": "i32", "Hq": "i32", "Hkv": "i32",
               "NBH": "i32", "qk_scale": "fp32", "sm_scale": "fp32"}
        constexprs = {"G": G, "NUM_STAGES": cfg["NUM_STAGES"], "CONSUMER_REGS": G_.CONSUMER_REGS,
                      "PRODUCER_REGS": G_.PRODUCER_REGS, "VARIANT": GC._debug_variant().get("VARIANT", 0)}
        aligned = ("dk_ptr", "dv_ptr", "lse_ptr", "delta_ptr")
    else:
        cfg = GC.dq_config(D)
        kv_desc = G_.descriptor(torch.empty(1, cfg["BN"], 2, D, dtype=dtype), cfg["BN"])
        fn = GC._attn_bwd_causal_dq_ws_kernel
        sig = {"q_ptr": ptr, "do_ptr": ptr, "lse_ptr": "*fp32", "delta_ptr": "*fp32", "dq_ptr": ptr,
               "k_desc": mangle_type(kv_desc), "v_desc": mangle_type(kv_desc), "Tq": "i32", "Tk": "i32",
               "Hq": "i32", "NBH": "i32", "qk_scale": "fp32", "sm_scale": "fp32"}
        constexprs = {"G": G, "BN": cfg["BN"], "NUM_STAGES": cfg["NUM_STAGES"], "CONSUMER_REGS": G_.CONSUMER_REGS,
                      "PRODUCER_REGS": G_.PRODUCER_REGS}
        aligned = ("q_ptr", "do_ptr", "lse_ptr", "delta_ptr", "dq_ptr")
    sig.update({name: "constexpr" for name in constexprs})
    assert list(sig) == fn.arg_names, (list(sig), fn.arg_names)
    attrs = {(list(sig).index(n), ): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(GluonASTSource(fn, sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=opts)


def compile_gluon_gdn_fwd(dtype=None, V: int = 128, HK: int = 16, HV: int = 32, t_bad: bool = True,
                          h0: bool = False, beta_mode: int = 0, state_v_first: bool = False, block_v: int = None):
    """The compiled Gluon GDN forward (ops/gated_delta_rule/kernels_gluon_sm90_fwd.py) at K = 128, as its launcher
    would launch it at bf16 (or ``dtype``) with ``block_v`` value columns per program (default its VBLOCK)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from dflash_kernels.ops.gated_delta_rule import kernels_gluon_sm90_fwd as GF

    dtype = dtype or torch.bfloat16
    x = torch.empty(1, GF.CHUNK, 2, 128, dtype=dtype)
    y = torch.empty(1, GF.CHUNK, 2, V, dtype=dtype)
    ptr = {torch.bfloat16: "*bf16", torch.float16: "*fp16"}[dtype]
    fn = GF._gdn_fwd_ws_kernel
    sig = {"q_desc": mangle_type(GF._descriptor(x, 128)), "k_desc": mangle_type(GF._descriptor(x, 128)),
           "v_desc": mangle_type(GF._descriptor(y, block_v or GF.VBLOCK)), "o_ptr": ptr, "A_ptr": "*fp32", "gcum_ptr": "*fp32",
           "beta_ptr": ptr, "t_bad_ptr": "*i32" if t_bad else "constexpr", "h0_ptr": "*fp32" if h0 else "constexpr",
           "ht_ptr": "*fp32", "T": "i32", "NT": "i32", "scale": "fp32"}
    constexprs = {"HK": HK, "HV": HV, "K": 128, "V": V, "BETA_MODE": beta_mode, "HAS_H0": h0, "HAS_T_BAD": t_bad,
                  "STATE_V_FIRST": state_v_first, "CONSUMER_REGS": GF.CONSUMER_REGS,
                  "PRODUCER_REGS": GF.PRODUCER_REGS}
    if not t_bad:
        constexprs["t_bad_ptr"] = None
    if not h0:
        constexprs["h0_ptr"] = None
    sig.update({name: "constexpr" for name in constexprs})
    sig = {name: sig[name] for name in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("o_ptr", "A_ptr", "gcum_ptr", "ht_ptr")}
    return triton.compile(GluonASTSource(fn, sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": GF.MAXNREG})


def structure_counts(ptx: str, ttgir: str) -> dict:
    """How many of each instruction that shows the kernel's structure the PTX holds."""
    return {"wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
            "tma": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
            "mbarrier": len(re.findall(r"\bmbarrier\.", ptx)),
            "setmaxnreg": len(re.findall(r"setmaxnreg", ptx)),
            "ws_regions": ttgir.count("ttg.warp_specialize(")}


def report(D: int, causal, dump: str = None, dtype=None, G: int = 4) -> dict:
    """One build's resources (``cubin_resources`` and the launch's shared memory) and structure counts; with
    ``dump``, its TTGIR and PTX written into that folder. ``causal``: False or True for the dense kernel,
    ``"dflash"`` for the DFlash-mask forward, ``"dflash_dkdv"`` / ``"dflash_dq"`` for the DFlash backward's
    kernels, ``"causal_dkdv"`` / ``"causal_dq"`` for the dense causal backward's (bf16, or ``dtype``; GQA ``G``
    for the backwards)."""
    if causal in ("gdn_fwd", "gdn_fwd_bv32"):
        compiled = compile_gluon_gdn_fwd(dtype, V=D, block_v=32 if causal.endswith("bv32") else None)
    elif causal == "dflash":
        compiled = compile_gluon_dflash(D, dtype=dtype)
    elif causal in ("dflash_dkdv", "dflash_dq"):
        compiled = compile_gluon_dflash_bwd(D, causal.split("_")[1], G=G, dtype=dtype)
    elif causal in ("causal_dkdv", "causal_dq"):
        compiled = compile_gluon_causal_bwd(D, causal.split("_")[1], G=G, dtype=dtype)
    else:
        compiled = compile_gluon_attention(D, causal, dtype)
    ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
    if dump:
        os.makedirs(dump, exist_ok=True)
        tag = {False: "full", True: "causal"}.get(causal, causal)
        tag += "" if dtype is None else "_" + str(dtype).split(".")[-1]
        tag += "" if G == 4 else f"_G{G}"
        for ext in ("ttgir", "ptx"):
            with open(os.path.join(dump, f"D{D}_{tag}.{ext}"), "w") as f:
                f.write(compiled.asm[ext])
    return {"shared": compiled.metadata.shared, **cubin_resources(compiled.asm["cubin"]),
            **structure_counts(ptx, ttgir)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dump", metavar="DIR", help="write each build's TTGIR and PTX into DIR")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("gluon_sm90_compile: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")
    import torch
    import triton

    from dflash_kernels.ops.attention import kernels_gluon_sm90 as G

    print(f"triton {triton.__version__}, sm_90, bf16, BM {G.BM} (2 consumer warpgroups x {G.BMW} rows) + "
          f"1 producer warp, maxnreg {G.MAXNREG}, setmaxnreg consumers {G.CONSUMER_REGS} / producer "
          f"{G.PRODUCER_REGS}; regs: per thread at launch")
    print(f"{'build':38s} {'shared B':>9s} {'regs':>5s} {'stack':>6s} {'STL':>4s} {'LDL':>4s} {'wgmma':>6s} "
          f"{'TMA':>4s} {'mbar':>5s} {'setmaxnreg':>10s} {'ws':>3s}")
    failed = False
    builds = [(D, c, None, 4) for D in (64, 128) for c in (False, True, "dflash")]
    builds += [(D, c, dt, 4) for c in ("dflash_dkdv", "dflash_dq") for D in (128, 64)
               for dt in (torch.bfloat16, torch.float16)]
    # The causal backward at GQA 1 (the dense benchmark's heads) and 4: G is a constant of its item loop.
    builds += [(D, c, dt, g) for c in ("causal_dkdv", "causal_dq") for g in (1, 4) for D in (128, 64)
               for dt in (torch.bfloat16, torch.float16)]
    # The GDN forward (K = 128; D here is V), Hk 16 / Hv 32.
    builds += [(V, c, dt, 4) for c in ("gdn_fwd", "gdn_fwd_bv32") for V in (128, 64)
               for dt in (torch.bfloat16, torch.float16)]
    for D, causal, dtype, g in builds:
        if str(causal).startswith("gdn_fwd"):
            from dflash_kernels.ops.gated_delta_rule import kernels_gluon_sm90_fwd as GF

            bv = 32 if causal.endswith("bv32") else GF.VBLOCK
            name = f"GDN fwd V{D} {str(dtype).split('.')[-1]} BV{bv} S{GF.STAGES}"
        elif causal in ("dflash_dkdv", "dflash_dq", "causal_dkdv", "causal_dq"):
            from dflash_kernels.ops.attention import kernels_gluon_sm90_dflash_bwd as GB

            cfg = (GB.dkdv_config if causal.endswith("dkdv") else GB.dq_config)(D)
            tag = f"{causal.replace('dflash_', '')} G{g} {str(dtype).split('.')[-1]}"
        else:
            cfg = G.tile_config(D)
            tag = {False: "full", True: "causal", "dflash": "dflash G4"}[causal]
        if not str(causal).startswith("gdn_fwd"):
            name = f"D{D} {tag} BN{cfg['BN']} S{cfg['NUM_STAGES']}"
        try:
            r = report(D, causal, args.dump, dtype, g)
        except Exception as e:  # noqa: BLE001 - a build the compiler rejects is a line, not a crash
            failed = True
            while e.__cause__ is not None:  # a CompilationError wraps the error of the innermost call
                e = e.__cause__
            print(f"{name:38s} does not compile ({type(e).__name__}: {str(e).strip()[:200]})")
            continue
        fits = "" if r["shared"] <= H200_SHARED_MEMORY else "  TOO MUCH SHARED MEMORY"
        print(f"{name:38s} {r['shared']:>9d} {r['regs']:>5d} {r['stack']:>6d} {r['stl']:>4d} {r['ldl']:>4d} "
              f"{r['wgmma']:>6d} {r['tma']:>4d} {r['mbarrier']:>5d} {r['setmaxnreg']:>10d} "
              f"{r['ws_regions']:>3d}{fits}", flush=True)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
