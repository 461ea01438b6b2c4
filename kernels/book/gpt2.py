"""GPT-2 family twins: the KV-cache ``MultiHeadAttention`` and the SDPA bonus class.

* :class:`FusedMultiHeadAttentionKV` <- ``llms_from_scratch.kv_cache.gpt2.MultiHeadAttention``
* :class:`FusedPyTorchMultiHeadAttention` <- ``llms_from_scratch.ch03.PyTorchMultiHeadAttention``
  (used by ``ch04.GPTModelFast``)

The chapter-3 classes (``CausalAttention``, ``MultiHeadAttention``, the wrapper) of the package
are the book's own and are swapped by ``kernels.fuse_attention`` for ``kernels.modules``' twins.
"""
import torch
import torch.nn as nn

from .. import ops as _ops
from ..model_checks import check_head_split
from .base import BookTwin


def _adopt_heads(cls, module):
    """``cls`` twin of ``module`` (its very children and Parameters) with its head split."""
    head_dim = check_head_split(int(module.d_out), int(module.num_heads))
    twin = cls._adopt(module)
    twin.d_out, twin.num_heads = int(module.d_out), int(module.num_heads)
    twin.head_dim = head_dim
    return twin


class FusedMultiHeadAttentionKV(BookTwin):
    """Fused twin of ``kv_cache.gpt2.MultiHeadAttention`` (GPT-2 attention with a KV cache).

    Same constructor, children (``W_query``, ``W_key``, ``W_value``, ``out_proj``, ``dropout``),
    state_dict and ``forward(x, use_cache=False, start_pos=0, cache=None) -> (context,
    next_cache)``: with ``use_cache`` the new keys/values (b, heads, n, hd) are appended to
    ``cache = (keys, values)`` and ``next_cache`` is the concatenation, else ``None``.
    ``start_pos`` is accepted and unused, as in the package (GPT-2's positions are added by the
    model).

    Attention is causal aligned bottom-right over the cache: the new queries see every cached
    key. That is what the package's module means; its 1.0.19 code slices the causal mask by
    columns (``causal_mask[:, -num_tokens:]``), so there every cached step after the first
    fails with a broadcast error. Dropout on the weights in training mode, drawn in the kernel.
    """

    book_classes = ("llms_from_scratch.kv_cache.gpt2.MultiHeadAttention",)

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.head_dim = check_head_split(d_out, num_heads)
        self.d_out = d_out
        self.num_heads = num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)

    @classmethod
    def from_module(cls, module):
        """Twin of a package module: its very children and Parameters, same mode."""
        return _adopt_heads(cls, module)

    def forward(self, x, use_cache=False, start_pos=0, cache=None):
        b, n, _ = x.shape
        shape = (b, n, self.num_heads, self.head_dim)
        # The projection modules (nn.Linear, LoRA wrappers, ...) in the package's order.
        k = self.W_key(x).view(shape).transpose(1, 2)       # (b, H, n, hd) views
        v = self.W_value(x).view(shape).transpose(1, 2)
        q = self.W_query(x).view(shape).transpose(1, 2)
        if use_cache:
            if cache is not None:
                k = torch.cat([cache[0], k], dim=2)
                v = torch.cat([cache[1], v], dim=2)
            next_cache = (k, v)
        else:
            next_cache = None
        p = float(self.dropout.p) if self.dropout.training else 0.0
        o = _ops.attention(q, k.to(q.dtype), v.to(q.dtype), causal=True, dropout_p=p)
        return self.out_proj(o.transpose(1, 2).reshape(b, n, self.d_out)), next_cache

    def extra_repr(self):
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}"


class FusedPyTorchMultiHeadAttention(BookTwin):
    """Fused twin of ``ch03.PyTorchMultiHeadAttention`` (one ``qkv`` projection, SDPA causal).

    Same constructor, children (``qkv``, ``proj``), ``dropout`` (a float, applied in training
    mode) and state_dict; ``forward(x) -> context``. The q, k, v heads are strided views of the
    one ``qkv`` projection, read in place by the kernel.
    """

    book_classes = ("llms_from_scratch.ch03.PyTorchMultiHeadAttention",)

    def __init__(self, d_in, d_out, num_heads, dropout=0.0, qkv_bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = check_head_split(d_out, num_heads)
        self.d_out = d_out
        self.qkv = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)
        self.proj = nn.Linear(d_out, d_out)
        self.dropout = dropout

    @classmethod
    def from_module(cls, module):
        twin = _adopt_heads(cls, module)
        twin.dropout = float(module.dropout)
        return twin

    def forward(self, x):
        b, n, _ = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.num_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))   # (b, H, n, hd) views
        p = float(self.dropout) if self.training else 0.0
        o = _ops.attention(q, k, v, causal=True, dropout_p=p)
        return self.proj(o.transpose(1, 2).reshape(b, n, self.d_out))

    def extra_repr(self):
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, dropout={self.dropout}"
