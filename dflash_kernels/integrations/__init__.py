"""Integrations of dflash_kernels into other libraries' models."""
