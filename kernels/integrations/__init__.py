"""Integrations built on the public functions (``kernels.ops``): drop-in modules, model
rewriting, the book's models, SDPA's flash slot, transformers and ring attention."""
