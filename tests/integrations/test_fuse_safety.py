"""fuse_attention safety: a model is never silently changed. Overridden or look-alike forwards
are swapped only after a numerical check, forwards the twin cannot call are never swapped, and
verbose/strict report what was left alone."""
import pytest
import torch
import torch.nn as nn

from helpers import DEVICE
from kernels import FusedMultiHeadAttention, fuse_attention
from reference import MultiHeadAttention


class Hotter(MultiHeadAttention):
    """The book's MultiHeadAttention with another softmax temperature (scores * 4)."""

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (lin(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
                   for lin in (self.W_query, self.W_key, self.W_value))
        scores = (q @ k.transpose(2, 3)).masked_fill(self.mask.bool()[:n, :n], -torch.inf)
        weights = self.dropout(torch.softmax(4 * scores / self.head_dim ** 0.5, dim=-1))
        return self.out_proj((weights @ v).transpose(1, 2).reshape(b, n, self.d_out))


class Same(MultiHeadAttention):
    """Overrides forward but computes the same thing: passes the numerical check."""

    def forward(self, x):
        return super().forward(x)


class WithCache(MultiHeadAttention):
    """A forward taking use_cache=: the twin's forward(x) cannot accept it."""

    def forward(self, x, use_cache=False):
        return super().forward(x)


def _mha(cls):
    torch.manual_seed(0)
    return cls(16, 16, 8, 0.0, num_heads=2).to(DEVICE)


def test_other_temperature_is_left_alone_and_reported(capsys):
    model = nn.ModuleList([_mha(Hotter), _mha(Same), _mha(WithCache)])
    _, count = fuse_attention(model, verbose=True)
    assert count == 1
    assert type(model[0]) is Hotter
    assert isinstance(model[1], FusedMultiHeadAttention)
    assert type(model[2]) is WithCache
    out = capsys.readouterr().out
    assert "0 (Hotter): left alone: forward differs" in out
    assert "1 (Same): swapped" in out
    assert "2 (WithCache): left alone: forward signature differs" in out


def test_strict_raises_listing_what_was_left_alone():
    model = nn.Sequential(_mha(Hotter))
    with pytest.raises(ValueError, match="Hotter"):
        fuse_attention(model, strict=True)
    assert type(model[0]) is Hotter
    # Nothing left alone: strict passes.
    assert fuse_attention(nn.Sequential(_mha(MultiHeadAttention)), strict=True)[1] == 1


def test_check_keeps_rng_and_training_mode():
    model = nn.Sequential(_mha(Same)).train()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    fuse_attention(model)
    assert torch.equal(torch.rand(3), expected)
    assert model[0].training and model.training
