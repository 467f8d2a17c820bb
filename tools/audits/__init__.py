"""Audits of the training step on the CPU: copies, casts and host synchronizations (see tools/README.md)."""
