"""The integrations' shared checks (kernels/model_checks.py): the causal pattern as a
mask, the head split, what an attention module declares. No kernel runs here."""
import pytest
import torch
import torch.nn as nn

from kernels import model_checks as checks


def _masked_by_formula(q_len, k_len):
    """The bottom-right causal rule written out: key j hidden from query i iff j > i + k - q."""
    i = torch.arange(q_len)[:, None]
    j = torch.arange(k_len)[None, :]
    return j > i + (k_len - q_len)


@pytest.mark.parametrize("q_len,k_len", [(1, 1), (4, 4), (3, 7), (0, 2), (5, 5)])
def test_causal_masked_is_the_bottom_right_rule(q_len, k_len):
    assert torch.equal(checks.causal_masked(q_len, k_len), _masked_by_formula(q_len, k_len))
    if q_len == k_len:   # the book's mask
        assert torch.equal(checks.causal_masked(q_len, k_len),
                           torch.ones(q_len, k_len, dtype=torch.bool).triu(1))


def test_mismatch_of_square_and_bottom_right_masks():
    ok = torch.ones(4, 4).triu(1)                      # float 0/1, as the reference saves it
    assert checks.causal_mask_mismatch(ok, 4, 4) is None
    assert checks.causal_mask_mismatch(ok.bool()[None, None], 4, 4) is None   # broadcast
    assert checks.causal_mask_mismatch(torch.ones(4, 4).triu(0), 4, 4) == (0, 0)
    top_left = torch.ones(2, 5, dtype=torch.bool).triu(1)
    assert checks.causal_mask_mismatch(top_left, 2, 5) == (0, 1)
    assert checks.causal_mask_mismatch(_masked_by_formula(2, 5), 2, 5) is None


def test_mismatch_of_ragged_rows():
    lens = (3, 5)
    good = torch.stack([torch.nn.functional.pad(_masked_by_formula(2, k), (0, 5 - k), value=True)
                        for k in lens])[:, None]      # (2, 1, 2, 5)
    assert checks.causal_mask_mismatch(good, 2, lens) is None
    bad = good.clone()
    bad[0, 0, 1, 4] = False                            # row 0 has no key 4: must stay masked
    assert checks.causal_mask_mismatch(bad, 2, lens) == (0, 0, 1, 4)


def test_head_split():
    assert checks.check_head_split(12, 4) == 3
    with pytest.raises(ValueError, match=r"d_out must be divisible by num_heads: got d_out=10, "
                                         r"num_heads=4 \(d_out % num_heads = 2\)"):
        checks.check_head_split(10, 4)
    with pytest.raises(ValueError, match="undefined"):
        checks.check_head_split(8, 0)
    with pytest.raises(ValueError, match=r"d_in must be divisible by num_heads when head_dim is "
                                         r"not set: got d_in=9"):
        checks.check_head_split(9, 2, name="d_in", when=" when head_dim is not set")


class _LoRA(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.linear = linear


class _Unknown(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(3, 5)   # never guessed from: not ``.linear``


def test_what_modules_declare():
    lin = nn.Linear(3, 5)
    assert checks.projection_features(lin) == (3, 5)
    assert checks.projection_features(_LoRA(_LoRA(lin))) == (3, 5)
    assert checks.projection_features(_Unknown()) == (None, None)
    att = nn.Module()
    att.W_query, att.W_key, att.W_value = _Unknown(), _LoRA(lin), lin
    assert checks.input_width(att) == 3
    att.register_buffer("mask", torch.ones(6, 6).triu(1))
    assert checks.context_length_of(att) == 6
    att.context_length = 8
    assert checks.context_length_of(att) == 8
    assert checks.is_plain_linear(lin)
    assert not checks.is_plain_linear(_LoRA(lin))

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)
    assert not checks.is_plain_linear(Scaled(3, 5))
