"""GPU diagnostic of the dense causal Gluon backward's dk / dv kernel (kernels_gluon_sm90_causal_bwd.py: its dk / dv
were wrong on its first GPU runs, until the kernel took every item through one masked call site; its module
docstring).

    python -m tools.studies.debug_causal_bwd [--variant 0,1,2,4,8,16,32,64,8+16+32+64] [--only NAME,...] [--full]

Each case runs in a subprocess of its own (a CUDA fault kills only that case and its stderr tail is printed).
Per case: the forward's lse / o against the fp32 reference, the rel err of dq, dk, dv, and for dk / dv per
64-key block (all batches and heads together): rel err, norm ratio got / ref, the least-squares scale c (got ~
c ref), and per key row the count of rows with rel err > 5e-2, exactly-zero rows, NaN rows, and the first bad key
indices. ``--variant V,...`` sets DFLASH_CAUSAL_BWD_VARIANT=V for the children (CUDA_LAUNCH_BLOCKING=1
always), one variant after the other; each V is an int (``24``, ``0x18``) or a sum of bits (``8+16``). The bits
of the dk / dv kernel's VARIANT (kernels_gluon_sm90_causal_bwd.py's docstring): 1 the diagonal mask by selects
after the MMAs instead of in the accumulators, 2 no off-diagonal items, 4 no diagonal items, 8 the consumers'
coordinates from the program id instead of the shared ``coords`` buffer, 16 Q / dO through rank-4
``[1, 64, 1, D]`` TMA boxes (the DFlash kernel's ``row_descriptor``), 32 the producer's row offsets per lane in
int64 (the DFlash producer's), 64 a ``fence_async_shared`` with the producer's barrier after its row stores,
128 the two consumer warpgroups' key blocks swapped, 256 the first design's second (unmasked) call site,
512 the query tiles in descending order (each block's diagonal item last);
with bit 2 or 4 the reference is restricted to the same (query tile, key block) pairs, so the error stays small
if the items that ran are right. A nonzero variant runs the small ``VARIANT_CASES`` with one line per case
(``--full``: the per-block / per-row patterns too); variant 0 runs every case in full.
"""

import argparse
import os
import subprocess
import sys
import time

# name: (B, Tq, Tk, Hq, Hkv, D, dtype, mode). mode: rand (randn q, k, v, do), q0 (q = 0: P uniform over the seen
# keys), q0do1 (q = 0 and do = 1), k0 (k = 0: P uniform, q random), nanq (rand with one NaN in q: errors are NaN,
# the NaN counts and the run itself are what matter)
CASES = {
    "T128_g1_rand": (1, 128, 128, 2, 2, 128, "bf16", "rand"),
    "T128_g1_q0do1": (1, 128, 128, 2, 2, 128, "bf16", "q0do1"),
    "T128_g1_k0": (1, 128, 128, 2, 2, 128, "bf16", "k0"),
    "T128_g1_D64": (1, 128, 128, 2, 2, 64, "bf16", "rand"),
    "T256_g1_rand": (1, 256, 256, 2, 2, 128, "bf16", "rand"),
    "T256_g4_rand": (1, 256, 256, 8, 2, 128, "bf16", "rand"),
    "T333_g1_rand": (1, 333, 333, 2, 2, 128, "bf16", "rand"),
    "q300_k77": (1, 300, 77, 2, 2, 128, "bf16", "rand"),
    "T1024_g1_rand": (1, 1024, 1024, 2, 2, 128, "bf16", "rand"),
    "T1024_g1_q0do1": (1, 1024, 1024, 2, 2, 128, "bf16", "q0do1"),
    "q333_k401_g4_D64": (2, 333, 401, 8, 2, 64, "fp16", "rand"),
    # the producer's suspect path (a NaN in q row 150, head 0): does it run (no fault, no hang)?
    "q333_k401_g4_nanq": (1, 333, 401, 8, 2, 128, "bf16", "nanq"),
}

VARIANT_CASES = ("T128_g1_rand", "T128_g1_D64", "T256_g4_rand", "T333_g1_rand", "T1024_g1_rand")
BITS = {1: "post-mask", 2: "no-off", 4: "no-diag", 8: "pid-coords", 16: "rank4-desc", 32: "int64-rows",
        64: "fence-rows", 128: "swap-blocks", 256: "two-sites", 512: "diag-last"}


def parse_variants(text):
    """``"0,8,8+16,0x18"`` -> [0, 8, 24, 24]: a comma list of ints or sums of ints."""
    return [sum(int(p, 0) for p in item.split("+")) for item in text.split(",") if item.strip()]


def variant_name(variant):
    """The names of the variant's bits, e.g. ``24 (pid-coords+rank4-desc)``."""
    names = [BITS.get(1 << i, f"bit{1 << i}") for i in range(variant.bit_length()) if variant >> i & 1]
    return f"{variant} ({'+'.join(names) or 'as designed'})"


def _inputs(B, Tq, Tk, Hq, Hkv, D, dtype, mode):
    import torch

    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Tq, Hq, D, generator=g)
    k = torch.randn(B, Tk, Hkv, D, generator=g)
    v = torch.randn(B, Tk, Hkv, D, generator=g)
    do = torch.randn(B, Tq, Hq, D, generator=g)
    if mode in ("q0", "q0do1"):
        q.zero_()
    if mode == "q0do1":
        do.fill_(1.0)
    if mode == "k0":
        k.zero_()
    if mode == "nanq":
        q[:, 150, 0, 7] = float("nan")
    return [x.to("cuda", dtype).contiguous() for x in (q, k, v, do)]


def _reference(q, k, v, do, scale, sel=None):
    """fp32 reference: o, lse [B, Hq, Tq], dq, dk, dv. ``sel``: None (all), "diag" or "off": dk / dv restricted
    to the (query t, key j) pairs with t // 64 == j // 64 (the diagonal items) or t // 64 > j // 64."""
    import torch

    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qf = q.float().transpose(1, 2)
    kf = k.float().repeat_interleave(G, dim=2).transpose(1, 2)
    vf = v.float().repeat_interleave(G, dim=2).transpose(1, 2)
    dof = do.float().transpose(1, 2)
    t = torch.arange(Tq, device=q.device)[:, None]
    j = torch.arange(Tk, device=q.device)[None, :]
    seen = j <= t
    s = (qf @ kf.transpose(-1, -2)) * scale
    s = s.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    o = p @ vf
    dp = dof @ vf.transpose(-1, -2)
    delta = (o * dof).sum(-1)
    ds = p * (dp - delta[..., None])
    dq = (ds @ kf) * scale
    if sel is not None:
        keep = (t // 64 == j // 64) if sel == "diag" else (t // 64 > j // 64)
        p = p * keep
        ds = ds * keep
    dk = (ds.transpose(-1, -2) @ qf) * scale  # [B, Hq, Tk, D]
    dv = p.transpose(-1, -2) @ dof
    dk = dk.view(B, Hkv, G, Tk, D).sum(2).transpose(1, 2)
    dv = dv.view(B, Hkv, G, Tk, D).sum(2).transpose(1, 2)
    return o.transpose(1, 2), lse, dq.transpose(1, 2), dk, dv


def _rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _pattern(name, got, ref):
    """Per 64-key block and per key row: where got [B, Tk, Hkv, D] differs from ref."""
    import torch

    got, ref = got.float(), ref.float()
    Tk = got.shape[1]
    out, errs = [], []
    for n in range(0, Tk, 64):
        g, r = got[:, n:n + 64], ref[:, n:n + 64]
        rn = r.norm().item()
        c = ((g * r).sum() / (r * r).sum().clamp_min(1e-30)).item()
        errs.append(_rel(g, r))
        out.append(f"    {name} keys [{n:4d},{min(n + 64, Tk):4d}): err {errs[-1]:8.2e}  |got|/|ref| "
                   f"{g.norm().item() / max(rn, 1e-30):7.3f}  c {c:7.3f}  |ref| {rn:9.3e}")
    if len(out) > 4:  # the first two blocks and the two worst others
        worst = sorted(range(2, len(out)), key=lambda i: -errs[i])[:2]
        out = out[:2] + [out[i] + " (worst)" for i in sorted(worst)]
    # per key row (all batches, heads, D together)
    gr = got.transpose(0, 1).reshape(Tk, -1)
    rr = ref.transpose(0, 1).reshape(Tk, -1)
    rnorm = rr.norm(dim=1)
    err = (gr - rr).norm(dim=1) / rnorm.clamp_min(1e-30)
    bad = (err > 5e-2) & (rnorm > 0)
    zero = (gr == 0).all(1) & (rnorm > 0)
    nan = gr.isnan().any(1)
    idx = bad.nonzero().flatten().tolist()
    ratio = (gr.norm(dim=1) / rnorm.clamp_min(1e-30))
    first = ", ".join(f"{i}:{ratio[i].item():.2f}" for i in idx[:8])
    out.append(f"    {name} rows: bad {len(idx)}/{Tk}  zero {int(zero.sum())}  nan {int(nan.sum())}  "
               f"first bad (key:|got|/|ref|) {first}")
    if len(idx) > 8:
        # which positions inside the 64-key blocks are bad: a hint at a mask / shift slip
        inblk = torch.bincount(torch.tensor(idx) % 64, minlength=64)
        out.append(f"    {name} bad rows by key % 64: lo[0,32) {int(inblk[:32].sum())}  hi[32,64) "
                   f"{int(inblk[32:].sum())}; by block: "
                   + " ".join(str(int(x)) for x in torch.bincount(torch.tensor(idx) // 64)))
    return out


def child(name, variant, full=True):
    import math

    import torch

    from dflash_kernels.ops.attention.kernels_gluon_sm90 import attention_fwd_gluon_sm90
    from dflash_kernels.ops.attention.kernels_gluon_sm90_causal_bwd import attention_bwd_gluon_sm90_causal

    B, Tq, Tk, Hq, Hkv, D, dt, mode = CASES[name]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
    q, k, v, do = _inputs(B, Tq, Tk, Hq, Hkv, D, dtype, mode)
    scale = 1.0 / math.sqrt(D)
    o, lse = attention_fwd_gluon_sm90(q, k, v, True, scale)
    torch.cuda.synchronize()
    dq, dk, dv = attention_bwd_gluon_sm90_causal(do, q, k, v, o, lse, scale)
    torch.cuda.synchronize()
    sel = {2: "diag", 4: "off"}.get(variant & 6)
    ro, rlse, rdq, rdk, rdv = _reference(q, k, v, do, scale, sel)
    if not full:  # one line
        bad = "  BAD" if _rel(dk, rdk) > 2e-2 or _rel(dv, rdv) > 2e-2 else ""
        print(f"  {name:18s} dq {_rel(dq, rdq):.2e} dk {_rel(dk, rdk):.2e} dv {_rel(dv, rdv):.2e} nan "
              f"{int(dq.isnan().sum())}/{int(dk.isnan().sum())}/{int(dv.isnan().sum())}"
              + (f" (ref: {sel} items)" if sel else "") + bad)
        return
    print(f"  fwd: o err {_rel(o, ro):.2e}  lse err {_rel(lse, rlse):.2e}  lse shape {tuple(lse.shape)} "
          f"stride {lse.stride()}")
    print(f"  dq {_rel(dq, rdq):.2e}  dk {_rel(dk, rdk):.2e}  dv {_rel(dv, rdv):.2e}"
          + (f"   (dk / dv reference restricted to {sel} items)" if sel else "")
          + (f"  nan: dq {int(dq.isnan().sum())} dk {int(dk.isnan().sum())} dv {int(dv.isnan().sum())}"))
    if Tk > Tq:
        print(f"  keys past Tq: |dk| {dk[:, Tq:].float().abs().max().item():.2e} "
              f"|dv| {dv[:, Tq:].float().abs().max().item():.2e} (want 0)")
    if _rel(dk, rdk) > 2e-2 or _rel(dv, rdv) > 2e-2:
        # per-head split of the error (kv heads): one head wrong = a head-offset bug
        hk_err = " ".join(f"{_rel(dk[:, :, h], rdk[:, :, h]):.1e}/{_rel(dv[:, :, h], rdv[:, :, h]):.1e}"
                          for h in range(Hkv))
        print(f"  per kv head dk/dv err: {hk_err}")
        print("\n".join(_pattern("dk", dk, rdk) + _pattern("dv", dv, rdv)))
        # dv when P were not masked on the diagonal blocks / double counted: the ratios to try
        with torch.no_grad():
            _, _, _, _, rdv_diag = _reference(q, k, v, do, scale, "diag")
            _, _, _, _, rdv_off = _reference(q, k, v, do, scale, "off")
            a = torch.stack([rdv_diag.float().flatten(), rdv_off.float().flatten()], 1)
            coef = torch.linalg.lstsq(a, dv.float().flatten()[:, None]).solution.flatten().tolist()
            res = _rel(a @ torch.tensor(coef, device=a.device), dv.float().flatten())
        print(f"  dv ~ {coef[0]:.3f} * dv_diag_items + {coef[1]:.3f} * dv_offdiag_items (residual {res:.2e})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="0",
                    help="comma list of variants, each an int or a sum of bits, e.g. 0,1,8,16,32,64,8+16+32+64 "
                    "(nonzero: only VARIANT_CASES, one line each)")
    ap.add_argument("--only", default="")
    ap.add_argument("--full", action="store_true", help="full output for nonzero variants too")
    ap.add_argument("--child", default="")
    ap.add_argument("--timeout", type=int, default=60)
    args = ap.parse_args()
    if args.child:
        child(args.child, parse_variants(args.variant)[0], args.full)
        return
    t_all = time.time()
    for variant in parse_variants(args.variant):
        full = args.full or variant == 0
        names = [n for n in CASES if (n in args.only.split(",") if args.only else
                                      (variant == 0 or n in VARIANT_CASES))]
        env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", DFLASH_KERNELS_POISON="1")
        env["DFLASH_CAUSAL_BWD_VARIANT"] = str(variant)
        print(f"######## variant {variant_name(variant)}", flush=True)
        for n in names:
            t0 = time.time()
            if full:
                print(f"== {n} {CASES[n]} (variant {variant})", flush=True)
            try:
                r = subprocess.run([sys.executable, "-m", "tools.studies.debug_causal_bwd", "--child", n,
                                    "--variant", str(variant)] + (["--full"] if full else []), env=env,
                                   capture_output=True, text=True, timeout=args.timeout)
                sys.stdout.write(r.stdout)
                if r.returncode != 0:
                    tail = "\n".join(r.stderr.strip().splitlines()[-8:])
                    print(f"  {n}: FAILED rc {r.returncode}:\n{tail}")
            except subprocess.TimeoutExpired:
                print(f"  {n}: TIMEOUT after {args.timeout} s (a hang: barrier protocol?)")
            if full:
                print(f"  ({time.time() - t0:.1f} s)", flush=True)
    print(f"total {time.time() - t_all:.1f} s")


if __name__ == "__main__":
    main()
