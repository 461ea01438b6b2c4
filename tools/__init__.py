"""Developer tools of this repository (run from its root, not installed): see each module's
docstring and docs/layout.md."""
