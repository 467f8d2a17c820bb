"""The Gluon sm_90 attention forwards (dense: kernels_gluon_sm90.py; DFlash mask: kernels_gluon_sm90_dflash.py),
the DFlash-mask backward's dk / dv and dq kernels (kernels_gluon_sm90_dflash_bwd.py) and the GDN forward
(ops/gated_delta_rule/kernels_gluon_sm90_fwd.py) compile for Hopper
on the CPU with the structure they are written for (tools/studies/gluon_sm90_compile.py):
one warp-specialized region with register rebalancing, the expected number of warpgroup MMAs, TMA copies, no
spills, shared memory within sm_90's limit.

Compiled in a subprocess without TRITON_INTERPRET (interpreted kernels cannot be compiled), so this runs in
the CPU suite too. The GPU test of the kernel's results is tests/ops/test_attention_gluon_sm90.py.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import H200_SHARED_MEMORY

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def reports():
    code = ("import json, torch; from tools.studies.gluon_sm90_compile import report; "
            "r = {f'{D} {c}': report(D, c) for D, c in "
            "((64, False), (128, True), (128, 'dflash'), (64, 'dflash'))}; "
            "r.update({f'{D} {c} {t}': report(D, c, dtype=getattr(torch, t)) for D in (128, 64) "
            "for c in ('dflash_dkdv', 'dflash_dq') for t in ('bfloat16', 'float16')}); "
            "r.update({f'{V} {c} {t}': report(V, c, dtype=getattr(torch, t)) for V, c, t in "
            "((128, 'gdn_fwd', 'bfloat16'), (128, 'gdn_fwd', 'float16'), (64, 'gdn_fwd', 'bfloat16'), "
            "(128, 'gdn_fwd_bv32', 'bfloat16'))}); "
            "print(json.dumps(r))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("build", ["64 False", "128 True"], ids=["D64_full", "D128_causal"])
def test_compiles_warp_specialized(reports, build):
    from dflash_kernels.ops.attention.kernels_gluon_sm90 import tile_config

    r = reports[build]
    D = int(build.split()[0])
    BN = tile_config(D)["BN"]
    assert r["shared"] <= H200_SHARED_MEMORY
    assert r["stl"] == 0 and r["ldl"] == 0, f"register spills: {r}"
    assert r["ws_regions"] == 1 and r["setmaxnreg"] > 0, f"no warp-specialized region with setmaxnreg: {r}"
    # Two consumers, each issuing S = Q K^T (D / 16 instructions of K = 16) and O += P V (BN / 16) at two sites
    # (the first tile's scores, the loop's pair, the last tile's P V).
    assert r["wgmma"] == 2 * 2 * (D // 16 + BN // 16), r
    assert r["tma"] >= 4 and r["mbarrier"] > 0, r


@pytest.mark.parametrize("D", [128, 64], ids=lambda d: f"D{d}")
def test_dflash_compiles_warp_specialized(reports, D):
    from dflash_kernels.ops.attention.kernels_gluon_sm90 import tile_config

    r = reports[f"{D} dflash"]
    BN = tile_config(D)["BN"]
    assert r["shared"] <= H200_SHARED_MEMORY
    assert r["stl"] == 0 and r["ldl"] == 0, f"register spills: {r}"
    assert r["ws_regions"] == 1 and r["setmaxnreg"] > 0, f"no warp-specialized region with setmaxnreg: {r}"
    # The dense kernel's consumer loop (_attend): the same MMA sites in both consumers.
    assert r["wgmma"] == 2 * 2 * (D // 16 + BN // 16), r
    # TMA only in the producer's K and V loads (Q and o go through plain loads and stores); a box row of D bf16
    # wider than the 128-byte swizzle is copied as 128-byte column pieces (two at D = 128).
    assert r["tma"] == 2 * (D * 2 // 128) and r["mbarrier"] > 0, r


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"], ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [128, 64], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("kernel", ["dflash_dkdv", "dflash_dq"], ids=["dkdv", "dq"])
def test_dflash_bwd_compiles_warp_specialized(reports, kernel, D, dtype):
    from dflash_kernels.ops.attention.kernels_gluon_sm90_dflash_bwd import KH, dq_config

    r = reports[f"{D} {kernel} {dtype}"]
    assert r["shared"] <= H200_SHARED_MEMORY
    assert r["stl"] == 0 and r["ldl"] == 0, f"register spills: {r}"
    assert r["ws_regions"] == 1 and r["setmaxnreg"] > 0, f"no warp-specialized region with setmaxnreg: {r}"
    pieces = D * 2 // 128  # TMA column pieces of a D-wide 16-bit box row (128-byte swizzle)
    if kernel == "dflash_dkdv":
        # Two consumers x two item sites (whole, masked): S^T, dP^T (D / 16 steps each), dV, dK (64 rows / 16).
        assert r["wgmma"] == 2 * 2 * (2 * (D // 16) + 2 * (64 // 16)), r
        # The producer's four K / V boxes (a static loop of two halves) and the Q, dO boxes at two sites (a stage
        # completed by the boxes' bytes; a stage loaded through `landed` for zeroing non-finite elements).
        assert r["tma"] == (4 + 2 * 2) * pieces and r["mbarrier"] > 0, r
        assert KH == 64
    else:
        BN = dq_config(D)["BN"]
        # Two consumers, one site: S, dP (D / 16 each) and dQ (BN / 16).
        assert r["wgmma"] == 2 * (2 * (D // 16) + BN // 16), r
        assert r["tma"] == 2 * pieces and r["mbarrier"] > 0, r


@pytest.mark.parametrize("build", ["128 gdn_fwd bfloat16", "128 gdn_fwd float16", "64 gdn_fwd bfloat16",
                                   "128 gdn_fwd_bv32 bfloat16"], ids=["V128_bf16", "V128_fp16", "V64_bf16", "BV32"])
def test_gdn_fwd_compiles_warp_specialized(reports, build):
    r = reports[build]
    assert r["shared"] <= H200_SHARED_MEMORY
    assert r["stl"] == 0 and r["ldl"] == 0, f"register spills: {r}"
    assert r["ws_regions"] == 1 and r["setmaxnreg"] > 0, f"no warp-specialized region with setmaxnreg: {r}"
    # K = 128, BT = 64, BV = 64 or 32 (the instruction's N); a 64-row MMA issues one instruction per 16 of its
    # reduction. The chain: K S0 (8), A X (4), S1 over 128 rows (2 x 4); the output warpgroup: Q K^T (8), Q S0 (8),
    # P U (4).
    assert r["wgmma"] == (8 + 4 + 8) + (8 + 8 + 4), r
    # q and k boxes: rows of 128 16-bit elements, two 128-byte pieces each; the v box one.
    assert r["tma"] == 5 and r["mbarrier"] > 0, r
