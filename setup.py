"""dflash_kernels: Triton attention / linear-attention kernels with a thread-safe runtime.

Install:  pip install -e ".[test]"     (the CPU machine: Triton interpreter and reference backends)
Peers:    pip install -e ".[peers]"    (CUDA machines only: flash-linear-attention, causal-conv1d)
"""

from setuptools import find_packages, setup

setup(
    name="dflash_kernels",
    version="0.1.0",
    description="Block-sparse attention, Gated DeltaNet and causal conv1d kernels with a thread-safe runtime",
    packages=find_packages(include=["dflash_kernels", "dflash_kernels.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.5", "triton>=3.4"],
    extras_require={
        # numpy < 2.4: Triton 3.6's interpreter converts 1-element arrays to Python ints, which
        # numpy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars").
        "test": ["pytest>=7", "numpy<2.4", "transformers>=5"],  # transformers: its GDN is a test oracle
        "peers": ["flash-linear-attention>=0.6", "causal-conv1d>=1.5"],
    },
)
