"""The TMA descriptors' shared layouts (runtime/tma.py): made once per box and dtype, equal to Triton's own."""

import pytest
import torch
from triton.experimental.gluon import language as gl

from dflash_kernels.runtime.tma import smem_layout


@pytest.mark.parametrize("dtype,gl_dtype", [(torch.bfloat16, gl.bfloat16), (torch.float16, gl.float16)])
@pytest.mark.parametrize("block", [[1, 128, 128], [1, 64, 128], [1, 64, 32], [64, 64], [128, 64]])
def test_smem_layout_is_tritons_and_made_once(block, dtype, gl_dtype):
    layout = smem_layout(block, dtype)
    assert layout == gl.NVMMASharedLayout.get_default_for(block, gl_dtype)
    assert smem_layout(list(block), dtype) is layout  # a list or a tuple: the same cached object
    assert smem_layout(tuple(block), dtype) is layout


def test_smem_layout_refuses_other_dtypes():
    with pytest.raises(ValueError, match="torch_dtype.*torch.float32"):
        smem_layout([64, 64], torch.float32)
