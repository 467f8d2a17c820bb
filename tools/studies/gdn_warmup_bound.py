"""The warm-up bound behind a sequence-split GDN forward (FlashQLA's "intra-card context parallel" idea), checked
in fp64 on the CPU with the plain recurrence.

A piece of a long sequence can start its scan from the state that a warm-up over the chunks just before it gives,
started from zero, instead of waiting for the scan of everything before it. One token's transition is
``S -> exp(g) (I - beta k k^T) S``. With ``k`` l2-normalised and ``beta`` in [0, 2], ``I - beta k k^T`` has
eigenvalues 1 and 1 - beta, so its norm is at most 1. The warm-up's error at the piece's start, the true
earlier state carried through the warm-up's transitions, is therefore at most
``exp(sum of g over the warm-up) * ||S_w||``, where ``S_w`` is the true state where the warm-up starts. A warm-up
long enough that the summed log decay reaches -17 (exp(-17) = 4e-8) is exact to fp32 rounding relative to the
state.

    python -m tools.studies.gdn_warmup_bound [--T 2048] [--K 32]

Prints, per decay scale and warm-up length, the error against the exact state, the bound, and whether it holds.
"""

import argparse

import torch


def scan(k, v, g, beta, t0, t1, S):
    """The recurrence over tokens ``[t0, t1)`` from state ``S`` [K, V]."""
    for t in range(t0, t1):
        S = torch.exp(g[t]) * (S - beta[t] * torch.outer(k[t], k[t] @ S)) + beta[t] * torch.outer(k[t], v[t])
    return S


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--K", type=int, default=32)
    args = ap.parse_args()
    torch.manual_seed(0)
    T, K = args.T, args.K
    p = 3 * T // 4  # the piece's first token
    for gscale in (0.02, 0.2, 1.0):  # log decay per token uniform in [-gscale, 0]
        k = torch.nn.functional.normalize(torch.randn(T, K, dtype=torch.float64), dim=-1)
        v = torch.randn(T, K, dtype=torch.float64)
        g = -gscale * torch.rand(T, dtype=torch.float64)
        beta = 2 * torch.rand(T, dtype=torch.float64)
        zero = torch.zeros(K, K, dtype=torch.float64)
        S_true = scan(k, v, g, beta, 0, p, zero)
        for n in (16, 64, 128, 256):
            w = p - n
            err = (scan(k, v, g, beta, w, p, zero) - S_true).norm().item()
            bound = torch.exp(g[w:p].sum()).item() * scan(k, v, g, beta, 0, w, zero).norm().item()
            print(f"decay scale {gscale:4.2f}, warm-up {n:3d} tokens (sum g {g[w:p].sum().item():8.2f}): "
                  f"error {err:.3e}, bound {bound:.3e}, relative error {err / S_true.norm().item():.2e}, "
                  f"holds {err <= bound * (1 + 1e-9)}")


if __name__ == "__main__":
    main()
