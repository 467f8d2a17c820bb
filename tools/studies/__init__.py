"""One-off studies: where the time of an op or a step goes, and how candidates compare (see tools/README.md)."""
