"""The kernel core: Triton kernels (forward, backward, split-KV merge, KV append), their
launchers and configs, the tile/visibility rules, the score pipeline and the PyTorch fallback.

Nothing here imports the public layer or the integrations."""
