"""The attention backward's dk/dv kernel over a grid of configs at the `real` preset's drafter shape
(B=1, S=3072 context keys, N=512 draft blocks of 16, Hq=32, Hkv=8, D=128, bf16), outside the tuner.

Each config (mask kv_tile x QM x SPLIT x EPI x warps x stages) is forced alone and the whole backward
(preprocess + dq + dk/dv; dq and the forward pinned to their first config) is timed with
``triton.testing.do_bench`` on the full-context mask and on a 2048-token window, weighted 3 : 2 as the
drafter's layers are; dk, dv are compared with the first QM=0 config's (relative error). GPU only.

    python -m tools.studies.sweep_dkdv compile I N   # compile configs I::N, one launch each (run N of these
                                                     # side by side to fill the Triton cache in parallel)
    python -m tools.studies.sweep_dkdv time          # time every config; the 12 fastest last
"""
import itertools
import json
import os
import sys

import torch
import triton.testing

import dflash_kernels as dk
from dflash_kernels.ops.attention import kernels as K
from dflash_kernels.ops.attention.attention import attention_bwd, attention_fwd
from dflash_kernels.runtime import Config

S, N, Hq, Hkv, D, BS = 3072, 512, 32, 8, 128, 16
WEIGHTS = ((None, 3), (2048, 2))  # (window, layers): the drafter's full-context and sliding layers


def configs():
    """(kv_tile, Config) pairs: a key tile of at least 16, kv_tile 32 with QM=1 only (QM=0 needs
    BN >= 64 rows for its M side to be worth it), kv_tile 128 unsplit only with QM=1 (registers)."""
    out = []
    for kvt, qm, split, epi, w, st in itertools.product((32, 64, 128), (0, 1), (1, 2), (1, 2), (4, 8), (2, 3)):
        if kvt // split < 16 or (kvt == 32 and (split == 2 or qm == 0)) or (kvt == 128 and split == 1 and qm == 0):
            continue
        out.append((kvt, Config(EPI=epi, SPLIT=split, QM=qm, num_warps=w, num_stages=st)))
    return out


class Case:
    def __init__(self):
        dev = torch.device("cuda")
        g = torch.Generator().manual_seed(0)
        self.anchors = torch.sort(torch.randint(1, S, (1, N), generator=g), dim=1).values.to(dev)
        self.q = torch.randn(1, N * BS, Hq, D, device=dev, dtype=torch.bfloat16)
        self.k = torch.randn(1, S + N * BS, Hkv, D, device=dev, dtype=torch.bfloat16)
        self.v = torch.randn_like(self.k)
        self.do = torch.randn_like(self.q)
        self.scale = D ** -0.5
        self.masks = {}

    def mask(self, kvt, window):
        if (kvt, window) not in self.masks:
            self.masks[kvt, window] = dk.dflash_block_mask(self.anchors, S, BS, window=window, kv_tile=kvt)
        return self.masks[kvt, window]

    def fwd(self, m):
        return attention_fwd(self.q, self.k, self.v, m.segments, m.seg_count, m.tiles, m.q_block, m.tile_width,
                             self.scale)

    def bwd(self, m, o, lse):
        return attention_bwd(self.do, self.q, self.k, self.v, o, lse, m.segments, m.seg_count, m.tiles,
                             m.rev_offsets, m.rev_full, m.rev_entries, m.q_block, m.kv_tile, m.tile_width,
                             self.scale)

    def run(self, kvt, cfg, window, bench):
        """(dq, dk, dv) with ``cfg`` forced on the dk/dv kernel, and the backward's median ms if ``bench``."""
        m = self.mask(kvt, window)
        o, lse = self.fwd(m)
        force(K.attention_bwd_dkdv_kernel, cfg)
        out = self.bwd(m, o, lse)
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(lambda: self.bwd(m, o, lse), warmup=10, rep=60,
                                     return_mode="median") if bench else None
        return out, ms


def force(kern, cfg):
    kern.configs = [cfg]
    kern.reset()


def main():
    os.environ["DFLASH_KERNELS_TUNE"] = "0"
    force(K.attention_fwd_kernel, K.attention_fwd_kernel.configs[0])
    force(K.attention_bwd_dq_kernel, K.attention_bwd_dq_kernel.configs[0])
    case, todo = Case(), configs()
    if sys.argv[1] == "compile":
        i, n = int(sys.argv[2]), int(sys.argv[3])
        for kvt, cfg in todo[i::n]:
            try:
                case.run(kvt, cfg, None, False)
            except Exception as e:  # noqa: BLE001 - reported, the timing phase records it too
                print("compile fail", kvt, cfg, type(e).__name__, str(e)[:100])
        return
    base = Config(EPI=1, SPLIT=1, QM=0, num_warps=4, num_stages=2)
    ref = {w: case.run(64, base, w, False)[0] for w, _ in WEIGHTS}
    rows = []
    for kvt, cfg in todo:
        r = dict(kvt=kvt, **cfg.as_dict())
        try:
            r["weighted"] = 0.0
            for w, layers in WEIGHTS:
                out, ms = case.run(kvt, cfg, w, True)
                r[f"ms_{w}"] = ms
                r[f"err_{w}"] = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                                    for a, b in zip(out[1:], ref[w][1:]))
                r["weighted"] += layers * ms
        except Exception as e:  # noqa: BLE001 - a config that fails is a row saying so
            r.pop("weighted", None)
            r["fail"] = f"{type(e).__name__}: {str(e)[:120]}"
        print(json.dumps(r), flush=True)
        rows.append(r)
    print("BEST")
    for r in sorted([r for r in rows if "weighted" in r], key=lambda r: r["weighted"])[:12]:
        print(json.dumps(r))
    m = case.mask(64, None)
    print("fwd_ms full", triton.testing.do_bench(lambda: case.fwd(m), warmup=10, rep=60, return_mode="median"))


if __name__ == "__main__":
    main()
