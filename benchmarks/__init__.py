"""Benchmarks of the fused attention kernel against PyTorch's attention implementations.

Run from a checkout (not installed): ``python -m benchmarks --help``. Importing the package does
nothing else; the command decides whether our kernel runs compiled (CUDA) or in Triton's CPU
interpreter (see ``benchmarks.cli``).
"""
