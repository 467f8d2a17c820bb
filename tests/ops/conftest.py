"""Tuning mode of the GPU suite: ``--tuning {off,on,default}``.

- ``--tuning on``: every kernel's candidates are timed (``DFLASH_KERNELS_TUNE=1``), so the suite runs the
  configs the tuner picks for its shapes;
- ``--tuning off``: each kernel's first config, untimed (``DFLASH_KERNELS_TUNE=0``; the conv's
  CUDA-vs-Triton choice takes its default, Triton);
- ``--tuning default`` (the default): the environment as it is (the runtime's default is tuning on).

The runtime reads ``DFLASH_KERNELS_TUNE`` at every compile (``settings.tuning_enabled``), not at import,
so setting it here, before any test runs, takes effect for the whole session. Tuning results go to the
throw-away cache folder tests/conftest.py sets, so a tuned run re-times in every session.

    python -m pytest tests/ops --tuning on     # the op GPU suite with every kernel tuned
    python -m pytest tests/ops --tuning off    # the op GPU suite on every kernel's first config
    DFLASH_KERNELS_TUNE=1 python -m pytest tests   # the whole suite (the variable works anywhere)

pytest registers a command-line option only from the conftest files it loads at startup: those of the
given paths and their ``test*`` subfolders, so ``--tuning`` is known when a path under tests/ops is
given, not for a bare ``python -m pytest tests`` (there, set ``DFLASH_KERNELS_TUNE`` instead, or move
these hooks to tests/conftest.py).
"""

import os

_ENV = {"on": "1", "off": "0"}


def pytest_addoption(parser):
    parser.addoption("--tuning", choices=("off", "on", "default"), default="default",
                     help="GPU kernels: time every candidate (on, DFLASH_KERNELS_TUNE=1), take each kernel's "
                          "first config (off, DFLASH_KERNELS_TUNE=0), or leave the environment as it is (default)")


def pytest_configure(config):
    mode = config.getoption("--tuning", default="default")
    if mode in _ENV:
        os.environ["DFLASH_KERNELS_TUNE"] = _ENV[mode]


def pytest_report_header(config):
    return f"dflash_kernels tuning: --tuning {config.getoption('--tuning', default='default')} " \
           f"(DFLASH_KERNELS_TUNE={os.environ.get('DFLASH_KERNELS_TUNE', 'unset')})"
