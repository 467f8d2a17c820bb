"""tools/studies/gdn_warmup_bound.py: the warm-up error of a sequence-split GDN scan is within
``exp(sum g) * ||S_w||`` for l2-normalised k and beta in [0, 2] (fp64, small sizes)."""

import pytest
import torch

from tools.studies.gdn_warmup_bound import scan


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gscale", [0.05, 0.5])
def test_warmup_error_within_bound(seed, gscale):
    g_ = torch.Generator().manual_seed(seed)
    T, K, V, p = 192, 8, 6, 160
    k = torch.nn.functional.normalize(torch.randn(T, K, generator=g_, dtype=torch.float64), dim=-1)
    v = torch.randn(T, V, generator=g_, dtype=torch.float64)
    g = -gscale * torch.rand(T, generator=g_, dtype=torch.float64)
    beta = 2 * torch.rand(T, generator=g_, dtype=torch.float64)
    zero = torch.zeros(K, V, dtype=torch.float64)
    S_true = scan(k, v, g, beta, 0, p, zero)
    for n in (4, 16, 64):
        w = p - n
        err = (scan(k, v, g, beta, w, p, zero) - S_true).norm().item()
        bound = torch.exp(g[w:p].sum()).item() * scan(k, v, g, beta, 0, w, zero).norm().item()
        assert 0 < err <= bound * (1 + 1e-9), (n, err, bound)
