"""tools/studies/bench_gdn_fwd_paths.py, the GDN forward-paths study's harness on the CPU: its arguments, the
forward form each implementation forces, and a clear refusal without a GPU (the timing itself needs one)."""

import os

import pytest

from tools.studies import bench_gdn_fwd_paths as bench


def test_arguments():
    args = bench.parse_args(["split", "--batch", "4", "--heads", "48", "--no-record"])
    assert (args.impl, args.batch, args.heads, args.no_record) == ("split", 4, 48, True)
    args = bench.parse_args(["fla"])
    assert (args.batch, args.heads, args.no_record) == (1, 32, False)
    with pytest.raises(SystemExit):
        bench.parse_args(["fast"])


def test_fused_and_split_force_the_form_auto_leaves_the_pick():
    # the library reads 0 / 1 as the fused / split forward; auto must leave the variable unset
    from dflash_kernels.runtime import settings

    for impl, expected in (("fused", False), ("split", True)):
        os.environ["DFLASH_KERNELS_GDN_FWD_SPLIT"] = bench.SPLIT_ENV[impl]
        try:
            assert settings.gdn_fwd_split() is expected
        finally:
            del os.environ["DFLASH_KERNELS_GDN_FWD_SPLIT"]
    assert "auto" not in bench.SPLIT_ENV and "fla" not in bench.SPLIT_ENV


@pytest.mark.skipif(bench.torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_refuses_without_a_gpu():
    with pytest.raises(SystemExit, match="no CUDA device"):
        bench.main(["fused", "--no-record"])
