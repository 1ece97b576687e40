"""stages.tensors: padding helpers and completion masks, on hand-made tensors."""

from __future__ import annotations

import pytest
import torch

from stages.tensors import completion_mask_from_eos, flush_left, pad, pad_to_length

T = torch.tensor


# -------------------------------------------------------------------------------- pad


@pytest.mark.parametrize(
    ("tensors", "kwargs", "expected"),
    [
        ([T([1, 2, 3]), T([4, 5])], {}, T([[1, 2, 3], [4, 5, 0]])),
        ([T([1, 2, 3]), T([4, 5])], dict(padding_side="left"), T([[1, 2, 3], [0, 4, 5]])),
        ([T([1, 2, 3]), T([4])], dict(padding_value=-1, pad_to_multiple_of=4), T([[1, 2, 3, -1], [4, -1, -1, -1]])),
        ([T([1, 2, 3, 4]), T([5])], dict(pad_to_multiple_of=4), T([[1, 2, 3, 4], [5, 0, 0, 0]])),
        (
            [T([[1, 2], [3, 4]]), T([[5]])],
            dict(padding_side="left"),
            T([[[1, 2], [3, 4]], [[0, 0], [0, 5]]]),
        ),
        ([T([1.5]), T([2.5, 3.5])], dict(padding_value=9.0), T([[1.5, 9.0], [2.5, 3.5]])),
    ],
    ids=["right", "left", "multiple-of", "multiple-of-exact", "2d-left", "float"],
)
def test_pad(tensors, kwargs, expected):
    out = pad(tensors, **kwargs)
    assert out.dtype == expected.dtype
    assert torch.equal(out, expected)


def test_pad_bad_input():
    with pytest.raises(ValueError, match="`tensors` must be a non-empty"):
        pad([])
    with pytest.raises(ValueError, match=r"same ndim.*tensors\[1\] has shape \(1, 2\)"):
        pad([T([1]), T([[1, 2]])])
    with pytest.raises(ValueError, match="`padding_side`"):
        pad([T([1])], padding_side="middle")
    with pytest.raises(ValueError, match="one dtype"):
        pad([T([1]), T([1.0])])


@pytest.mark.parametrize(
    ("tensor", "length", "kwargs", "expected"),
    [
        (T([[1, 2], [3, 4]]), 4, dict(pad_value=0), T([[1, 2, 0, 0], [3, 4, 0, 0]])),
        # TRL's semantics: a longer tensor comes back as it is, never truncated
        (T([[1, 2, 3], [4, 5, 6]]), 2, dict(pad_value=0), T([[1, 2, 3], [4, 5, 6]])),
        (T([[1, 2], [3, 4]]), 3, dict(pad_value=7, dim=0), T([[1, 2], [3, 4], [7, 7]])),
        (T([[1, 2], [3, 4]]), 4, dict(pad_value=9, padding_side="left"), T([[9, 9, 1, 2], [9, 9, 3, 4]])),
        (T([[1, 2]]), 2, dict(pad_value=0), T([[1, 2]])),
    ],
    ids=["pad", "longer-unchanged", "dim0", "left-pad", "same"],
)
def test_pad_to_length(tensor, length, kwargs, expected):
    assert torch.equal(pad_to_length(tensor, length, **kwargs), expected)


def test_flush_left_exact():
    mask = T([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    ids = T([[9, 9, 1, 2, 3], [9, 4, 5, 9, 9], [6, 7, 9, 9, 9]])
    logps = ids.float()[..., None].expand(3, 5, 2) * T([1.0, -1.0])  # (B, T, 2) extra trailing dim
    new_mask, new_ids, new_logps = flush_left(mask, ids, logps)
    assert torch.equal(new_mask, T([[1, 1, 1], [1, 1, 0], [1, 1, 0]]))
    assert torch.equal(new_ids, T([[1, 2, 3], [4, 5, 9], [6, 7, 9]]))
    assert torch.equal(new_logps, new_ids.float()[..., None] * T([1.0, -1.0]))
    # mask only: returns the mask itself, and leaves the input untouched.
    assert torch.equal(flush_left(mask), new_mask)
    assert torch.equal(mask[0], T([0, 0, 1, 1, 1]))


def test_flush_left_keeps_inner_holes_and_bool_mask():
    mask = T([[0, 1, 0, 1, 0, 0], [0, 0, 0, 0, 1, 0]]).bool()
    assert torch.equal(flush_left(mask), T([[True, False, True], [True, False, False]]))


def test_flush_left_bad_input():
    with pytest.raises(ValueError, match=r"`tensors\[0\]` must have shape \(2, 3, \.\.\.\)"):
        flush_left(torch.ones(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"`mask` must be a \(B, T\)"):
        flush_left(torch.ones(3))


# ------------------------------------------------------------ completion_mask_from_eos


def test_completion_mask_from_eos_pad_equals_eos():
    eos = pad_id = 2
    ids = T([[5, 6, eos, pad_id, pad_id], [5, 6, 7, 8, 9], [eos, pad_id, pad_id, pad_id, pad_id],
             [5, eos, 7, eos, pad_id]])
    mask = completion_mask_from_eos(ids, eos)
    assert mask.dtype == torch.long
    assert torch.equal(mask, T([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]))
    # `ids != pad` would have dropped the emitted EOS; the positional mask keeps it.
    assert not torch.equal(mask, (ids != pad_id).long())


def test_completion_mask_from_eos_several_ids_and_bad_input():
    ids = T([[5, 3, 1, 1], [5, 6, 4, 1]])
    assert torch.equal(completion_mask_from_eos(ids, [3, 4]), T([[1, 1, 0, 0], [1, 1, 1, 0]]))
    with pytest.raises(ValueError, match=r"`completion_ids` must be a \(B, T\)"):
        completion_mask_from_eos(T([1, 2]), 1)
    with pytest.raises(ValueError, match="`eos_token_id`"):
        completion_mask_from_eos(ids, [])
