"""Development tools (studies, audits, GPU-session scripts): not part of the package; see tools/README.md."""
