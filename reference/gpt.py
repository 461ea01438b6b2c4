"""The GPT-2 (124M) model of "Build a Large Language Model (From Scratch)", chapter 4.

Faithful to the book (names, layer order, parameter creation order), except that the
configuration is passed as a dict (``GPT_CONFIG_124M``) instead of read from module globals.

Shapes: ``b`` batch, ``n`` tokens, ``emb_dim`` model width, ``vocab_size`` vocabulary size.
"""
import torch
import torch.nn as nn

from .modules import MultiHeadAttention

GPT_CONFIG_124M = {
    "vocab_size": 50257,     # vocabulary size (GPT-2 BPE)
    "context_length": 1024,  # longest input sequence
    "emb_dim": 768,          # embedding dimension
    "n_heads": 12,           # attention heads
    "n_layers": 12,          # transformer blocks
    "drop_rate": 0.1,        # dropout rate
    "qkv_bias": False,       # bias in the query/key/value projections
}


class LayerNorm(nn.Module):
    """Layer normalisation over the last dim with learnable ``scale`` and ``shift``.

    ``forward(x)``: x (..., emb_dim) -> same shape. Uses the biased variance (``unbiased=False``)
    like GPT-2's original TensorFlow code, with eps = 1e-5 inside the square root.
    """

    def __init__(self, emb_dim):
        super().__init__()
        self.eps = 1e-5
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x):
        """x (..., emb_dim) -> (..., emb_dim)."""
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)
        norm_x = (x - mean) / torch.sqrt(var + self.eps)
        return self.scale * norm_x + self.shift


class GELU(nn.Module):
    """GELU activation, tanh approximation (as GPT-2 was trained with). Elementwise, any shape."""

    def __init__(self):
        super().__init__()

    def forward(self, x):
        """x (any shape) -> same shape."""
        return 0.5 * x * (1 + torch.tanh(
            torch.sqrt(torch.tensor(2.0 / torch.pi)) * (x + 0.044715 * torch.pow(x, 3))))


class FeedForward(nn.Module):
    """Position-wise MLP: Linear(emb_dim, 4*emb_dim) -> GELU -> Linear(4*emb_dim, emb_dim).

    ``forward(x)``: x (b, n, emb_dim) -> (b, n, emb_dim).
    """

    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(cfg["emb_dim"], 4 * cfg["emb_dim"]),
            GELU(),
            nn.Linear(4 * cfg["emb_dim"], cfg["emb_dim"]),
        )

    def forward(self, x):
        """x (b, n, emb_dim) -> (b, n, emb_dim)."""
        return self.layers(x)


class TransformerBlock(nn.Module):
    """Pre-LayerNorm transformer block: x + drop(att(norm1(x))), then x + drop(ff(norm2(x))).

    ``forward(x)``: x (b, n, emb_dim) -> (b, n, emb_dim), n <= context_length.
    """

    def __init__(self, cfg):
        super().__init__()
        self.att = MultiHeadAttention(
            d_in=cfg["emb_dim"],
            d_out=cfg["emb_dim"],
            context_length=cfg["context_length"],
            num_heads=cfg["n_heads"],
            dropout=cfg["drop_rate"],
            qkv_bias=cfg["qkv_bias"])
        self.ff = FeedForward(cfg)
        self.norm1 = LayerNorm(cfg["emb_dim"])
        self.norm2 = LayerNorm(cfg["emb_dim"])
        self.drop_shortcut = nn.Dropout(cfg["drop_rate"])

    def forward(self, x):
        """x (b, n, emb_dim) -> (b, n, emb_dim)."""
        # Shortcut connection around the attention sub-block
        shortcut = x
        x = self.norm1(x)
        x = self.att(x)  # (b, n, emb_dim)
        x = self.drop_shortcut(x)
        x = x + shortcut

        # Shortcut connection around the feed-forward sub-block
        shortcut = x
        x = self.norm2(x)
        x = self.ff(x)
        x = self.drop_shortcut(x)
        x = x + shortcut
        return x


class GPTModel(nn.Module):
    """GPT-2 style decoder: token + position embeddings, ``n_layers`` blocks, final norm, head.

    ``forward(in_idx)``: token ids (b, n) int64, n <= context_length -> logits (b, n, vocab_size).
    With ``GPT_CONFIG_124M`` it has 163,009,536 parameters (the output head is not tied to the
    token embedding, hence more than GPT-2's 124M).
    """

    def __init__(self, cfg):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"])
        self.pos_emb = nn.Embedding(cfg["context_length"], cfg["emb_dim"])
        self.drop_emb = nn.Dropout(cfg["drop_rate"])

        self.trf_blocks = nn.Sequential(
            *[TransformerBlock(cfg) for _ in range(cfg["n_layers"])])

        self.final_norm = LayerNorm(cfg["emb_dim"])
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False)

    def forward(self, in_idx):
        """in_idx (b, n) int64 -> logits (b, n, vocab_size)."""
        batch_size, seq_len = in_idx.shape
        tok_embeds = self.tok_emb(in_idx)
        pos_embeds = self.pos_emb(torch.arange(seq_len, device=in_idx.device))
        x = tok_embeds + pos_embeds  # (b, n, emb_dim)
        x = self.drop_emb(x)
        x = self.trf_blocks(x)
        x = self.final_norm(x)
        logits = self.out_head(x)
        return logits


def generate_text_simple(model, idx, max_new_tokens, context_size):
    """Greedy decoding: append ``max_new_tokens`` argmax tokens to ``idx``.

    idx (b, n) int64 token ids -> (b, n + max_new_tokens). Only the last ``context_size`` tokens
    are fed to the model at each step. Call ``model.eval()`` first for deterministic output.
    """
    for _ in range(max_new_tokens):
        # Crop the context to what the model supports
        idx_cond = idx[:, -context_size:]
        with torch.no_grad():
            logits = model(idx_cond)

        # Only the last time step matters: (b, n, vocab_size) -> (b, vocab_size)
        logits = logits[:, -1, :]
        probas = torch.softmax(logits, dim=-1)  # (b, vocab_size); argmax is unchanged by it
        idx_next = torch.argmax(probas, dim=-1, keepdim=True)  # (b, 1)
        idx = torch.cat((idx, idx_next), dim=1)  # (b, n + 1)

    return idx
