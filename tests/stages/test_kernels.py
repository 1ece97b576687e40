"""Equivalence, gradient and input-validation tests for stages.kernels (CPU, fast)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from stages.kernels import chunked_logprobs, entropy_from_logits, selective_log_softmax

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
V = 1003  # odd vocab so chunks never line up with vector widths


def _naive(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if index.dim() == logits.dim() - 1:
        return torch.gather(logits.log_softmax(-1), -1, index.unsqueeze(-1)).squeeze(-1)
    return torch.gather(logits.log_softmax(-1), -1, index)


def _logits(dtype, shape=(3, 17, V), seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 4).to(dtype)


def _index(shape, seed=1, vocab=V):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


class _Allocations(TorchDispatchMode):
    """Records the byte size of every fresh tensor an aten op returns.

    An output is fresh when its storage is not the storage of one of the op's inputs, so
    views, in-place ops and ``out=`` ops (which reuse buffers) are not counted.
    """

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []
        self.matmuls = 0  # mm / addmm calls (any overload)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.matmuls += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_)
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in inputs:
                self.sizes.append(t.untyped_storage().nbytes())
        return out

    def count_at_least(self, nbytes: int) -> int:
        return sum(s >= nbytes for s in self.sizes)


# --------------------------------------------------------------- selective_log_softmax


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [None, 4], ids=["index(...)", "index(...,K)"])
# chunk budgets: 1 row per chunk, 7 rows (chunks straddle batch rows), default (one chunk)
@pytest.mark.parametrize("chunk_bytes", [1, 7 * V * 4, None], ids=["1row", "7rows", "default"])
def test_selective_log_softmax_matches_naive(dtype, k, chunk_bytes):
    logits = _logits(dtype)
    index = _index((3, 17) if k is None else (3, 17, k))
    out = selective_log_softmax(logits, index, chunk_bytes=chunk_bytes)
    ref = _naive(logits, index)
    assert out.shape == index.shape
    assert out.dtype == dtype
    if dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(out, ref)  # bit-identical for half types
    else:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_selective_log_softmax_noncontiguous_shift_slice(dtype):
    # logits[:, :-1] is not viewable as (-1, V); the kernel must still be exact.
    full = _logits(dtype, (4, 9, V))
    logits, index = full[:, :-1], _index((4, 9))[:, 1:]
    assert not logits.is_contiguous()
    out = selective_log_softmax(logits, index, chunk_bytes=5 * V * 4)
    ref = _naive(logits, index)
    if dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_selective_log_softmax_1d_and_empty():
    logits = _logits(torch.float32, (V,))
    index = torch.tensor(5)
    torch.testing.assert_close(selective_log_softmax(logits, index), logits.log_softmax(-1)[5])
    out = selective_log_softmax(torch.randn(0, 7, 11), torch.zeros(0, 7, dtype=torch.long))
    assert out.shape == (0, 7)


@pytest.mark.parametrize("k", [None, 3], ids=["index(...)", "index(...,K)"])
@pytest.mark.parametrize("chunk_bytes", [1, 5 * V * 4], ids=["1row", "5rows"])
def test_selective_log_softmax_gradients_match_naive(k, chunk_bytes):
    base = _logits(torch.float32, (3, 12, V))
    index = _index((3, 11) if k is None else (3, 11, k))
    grad_out = torch.randn(index.shape, generator=torch.Generator().manual_seed(2))

    a = base.clone().requires_grad_()
    out = selective_log_softmax(a[:, 1:], index, chunk_bytes=chunk_bytes)
    (ga,) = torch.autograd.grad(out, a, grad_out)
    b = base.clone().requires_grad_()
    (gb,) = torch.autograd.grad(_naive(b[:, 1:], index), b, grad_out)
    torch.testing.assert_close(ga, gb, atol=1e-5, rtol=0)
    assert ga[:, 0].abs().max() == 0  # the sliced-off column gets no gradient


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_selective_log_softmax_gradients_other_dtypes(dtype):
    base = _logits(dtype, (2, 5, V))
    index = _index((2, 5))
    a = base.clone().requires_grad_()
    (ga,) = torch.autograd.grad(selective_log_softmax(a, index, chunk_bytes=3 * V * 4).sum(), a)
    assert ga.dtype == dtype
    b = base.double().requires_grad_()
    (gb,) = torch.autograd.grad(_naive(b, index).sum(), b)
    tol = 1e-12 if dtype == torch.float64 else 1e-2
    torch.testing.assert_close(ga.double(), gb, atol=tol, rtol=0)


def test_selective_log_softmax_gradcheck_float64():
    logits = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, 6, (2, 3, 2))
    assert torch.autograd.gradcheck(lambda x: selective_log_softmax(x, index, chunk_bytes=16), (logits,))


@pytest.mark.parametrize("fn", ["selective", "entropy"])
def test_chunked_kernels_never_allocate_a_full_size_tensor(fn):
    full = torch.randn(4, 17, 500, requires_grad=True)
    logits, index = full[:, :-1], _index((4, 16), vocab=500)  # non-viewable slice: must not be copied
    full_bytes = logits.numel() * 4
    rows = 8

    def ours():
        if fn == "selective":
            return selective_log_softmax(logits, index, chunk_bytes=rows * 500 * 4)
        return entropy_from_logits(logits, rows)

    def naive():
        if fn == "selective":
            return _naive(logits, index)
        return -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)

    for run in (ours, naive):
        with _Allocations() as fwd:
            out = run()
        with _Allocations() as bwd:  # gradient w.r.t. the slice itself, not the slice's base
            torch.autograd.grad(out, logits, torch.ones_like(out))
        # ours: forward never holds more than a chunk (two chunk buffers for entropy);
        # backward allocates exactly one full-size tensor, the gradient. The naive path
        # is checked too so the detector is known to see full-size allocations.
        if run is ours:
            assert max(fwd.sizes) <= rows * 500 * 4, fwd.sizes
            assert bwd.count_at_least(full_bytes // 4) == 1, bwd.sizes
            assert bwd.count_at_least(full_bytes) == 1, bwd.sizes
        else:
            assert fwd.count_at_least(full_bytes) >= 1, fwd.sizes
            assert bwd.count_at_least(full_bytes) >= 2, bwd.sizes


@pytest.mark.parametrize(
    ("logits", "index", "match"),
    [
        (torch.randint(0, 5, (2, 3, 7)), torch.zeros(2, 3, dtype=torch.long),
         r"`logits` must be a floating-point.*int64"),
        (torch.randn(2, 3, 7), torch.zeros(2, 4, dtype=torch.long), r"`index` must have shape \(2, 3\).*got \(2, 4\)"),
        (torch.randn(2, 3, 7), torch.zeros(3, dtype=torch.long), r"`index` must have shape"),
        (torch.randn(2, 3, 7), torch.full((2, 3), 7), r"`index` values must lie in \[0, V=7\).*max=7"),
        (torch.randn(2, 3, 7), torch.full((2, 3), -1), r"`index` values must lie in \[0, V=7\).*min=-1"),
        (torch.randn(2, 3, 7), torch.zeros(2, 3), r"`index` must be an integer tensor"),
    ],
    ids=["int-logits", "shape", "ndim", "too-large", "negative", "float-index"],
)
def test_selective_log_softmax_bad_input(logits, index, match):
    with pytest.raises(ValueError, match=match):
        selective_log_softmax(logits, index)


# ----------------------------------------------------------------- entropy_from_logits


def _naive_entropy(logits):
    x = logits.double()
    return -(x.softmax(-1) * x.log_softmax(-1)).sum(-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunk_size", [1, 7, None])
def test_entropy_matches_naive(dtype, chunk_size):
    logits = _logits(dtype)[:, 1:]
    ent = entropy_from_logits(logits, chunk_size)
    assert ent.shape == logits.shape[:-1] and ent.dtype == dtype
    tol = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5, torch.float64: 1e-10}[dtype]
    torch.testing.assert_close(ent.double(), _naive_entropy(logits), atol=tol, rtol=tol)


def test_entropy_gradients_match_naive():
    base = _logits(torch.float32, (3, 6, V))
    grad_out = torch.randn(3, 6, generator=torch.Generator().manual_seed(3))
    a = base.clone().requires_grad_()
    (ga,) = torch.autograd.grad(entropy_from_logits(a, 4), a, grad_out)
    b = base.clone().requires_grad_()
    (gb,) = torch.autograd.grad(-(b.softmax(-1) * b.log_softmax(-1)).sum(-1), b, grad_out)
    torch.testing.assert_close(ga, gb, atol=1e-5, rtol=0)


def test_entropy_bad_input():
    with pytest.raises(ValueError, match="`logits` must be a floating-point"):
        entropy_from_logits(torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="`chunk_size` must be a positive"):
        entropy_from_logits(torch.randn(2, 3), 0)


# -------------------------------------------------------------------- chunked_logprobs


def _head(dtype, n_shape=(2, 13), hidden=16, vocab=97, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*n_shape, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).to(dtype)
    b = torch.randn(vocab, generator=g).to(dtype) if bias else None
    idx = torch.randint(0, vocab, n_shape, generator=g)
    return h, w, b, idx


def _logits_path(h, w, b, idx, temperature):
    z = F.linear(h, w, b)
    z = z.double() if z.dtype == torch.float64 else z.float()
    z = z / temperature
    logp = selective_log_softmax(z, idx)
    ent = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    return logp, ent


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("use_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("return_entropy", [False, True], ids=["logp", "logp+entropy"])
# log-softmax rows kept for the backward: none (every chunk's logits recomputed), two chunks of 5 of the 26 rows, all
@pytest.mark.parametrize("keep", ["recompute", "partial", "kept"])
def test_chunked_logprobs_values_and_gradients(dtype, temperature, use_bias, return_entropy, keep):
    h0, w0, b0, idx = _head(dtype, bias=use_bias)
    row_bytes = w0.shape[0] * (8 if dtype == torch.float64 else 4)
    keep_bytes = {"recompute": 0, "partial": 12 * row_bytes, "kept": None}[keep]
    g = torch.Generator().manual_seed(9)
    g_lp, g_ent = torch.randn(idx.shape, generator=g), torch.randn(idx.shape, generator=g)

    def run(fn):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        b = b0.clone().requires_grad_() if use_bias else None
        logp, ent = fn(h, w, b)
        loss = (logp * g_lp).sum() + ((ent * g_ent).sum() if ent is not None else 0)
        params = (h, w) + ((b,) if use_bias else ())
        return logp, ent, torch.autograd.grad(loss, params)

    def ours(h, w, b):
        out = chunked_logprobs(h, w, idx, bias=b, temperature=temperature, chunk_size=5, return_entropy=return_entropy,
                               keep_bytes=keep_bytes)
        return out if return_entropy else (out, None)

    def ref(h, w, b):
        logp, ent = _logits_path(h, w, b, idx, temperature)
        return logp, ent if return_entropy else None

    lp, ent, grads = run(ours)
    lp_ref, ent_ref, grads_ref = run(ref)
    assert lp.shape == idx.shape
    assert lp.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(lp, lp_ref, atol=1e-5, rtol=0)
    if return_entropy:
        torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=0)
    for name, a, r in zip(("hidden", "weight", "bias"), grads, grads_ref, strict=False):  # no bias: 2 grads
        assert a.dtype == dtype, name
        if dtype == torch.bfloat16:
            # per-chunk bf16 matmuls round differently; compare at bf16 resolution.
            torch.testing.assert_close(a.float(), r.float(), atol=5e-2, rtol=2e-2, msg=name)
        else:
            torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5, msg=name)


def test_chunked_logprobs_entropy_only_gradient_and_frozen_head():
    h0, w0, _, idx = _head(torch.float32, bias=False)
    h, w = h0.clone().requires_grad_(), w0.clone()  # frozen weight: no grad requested
    _, ent = chunked_logprobs(h, w, idx, chunk_size=4, return_entropy=True)
    (gh,) = torch.autograd.grad(ent.sum(), h)
    h2 = h0.clone().requires_grad_()
    _, ent_ref = _logits_path(h2, w0, None, idx, 1.0)
    (gh_ref,) = torch.autograd.grad(ent_ref.sum(), h2)
    torch.testing.assert_close(gh, gh_ref, atol=1e-5, rtol=1e-5)


def test_chunked_logprobs_never_allocates_logits():
    n, hidden_size, vocab, rows = 64, 16, 1000, 8
    h0, w0, _, idx = _head(torch.float32, n_shape=(n,), hidden=hidden_size, vocab=vocab, bias=False)
    logits_bytes = n * vocab * 4
    for path in ("ours", "logits"):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        with _Allocations() as allocs:
            if path == "ours":
                lp, ent = chunked_logprobs(h, w, idx, chunk_size=rows, return_entropy=True, keep_bytes=0)
            else:
                lp, ent = _logits_path(h, w, None, idx, 1.0)
            (lp.sum() + ent.sum()).backward()
        if path == "ours":
            # chunk buffers (rows x V) and the (V, H) weight gradient are the largest
            assert max(allocs.sizes) == max(rows * vocab * 4, vocab * hidden_size * 4)
        else:
            assert allocs.count_at_least(logits_bytes) >= 2  # detector sanity: logits + their grad


def test_chunked_logprobs_keeps_the_forward_rows_it_may_and_skips_their_matmul():
    """Within `keep_bytes` the forward's log-softmax rows stay for the backward, which then computes only the two
    gradients' matmuls per chunk, not the logits again; without gradients nothing is kept."""
    n, vocab, rows = 64, 1000, 8
    h0, w0, _, idx = _head(torch.float32, n_shape=(n,), hidden=16, vocab=vocab, bias=False)
    chunks = n // rows
    for keep_bytes, kept_rows in ((0, 0), (3 * rows * vocab * 4 + 5, 3 * rows), (n * vocab * 4, n)):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        with _Allocations() as allocs:
            lp = chunked_logprobs(h, w, idx, chunk_size=rows, keep_bytes=keep_bytes)
        forward_matmuls = allocs.matmuls
        with _Allocations() as allocs:
            lp.sum().backward()
        assert forward_matmuls == chunks
        assert allocs.matmuls == 3 * chunks - kept_rows // rows, keep_bytes
    with torch.no_grad(), _Allocations() as allocs:
        chunked_logprobs(h0, w0, idx, chunk_size=rows, keep_bytes=n * vocab * 4)
    assert max(allocs.sizes) == rows * vocab * 4  # the chunk buffers only


def test_chunked_logprobs_noncontiguous_hidden():
    h0, w0, _, idx = _head(torch.float32, n_shape=(3, 9), bias=False)
    out = chunked_logprobs(h0[:, :-1], w0, idx[:, 1:], chunk_size=4)
    ref, _ = _logits_path(h0[:, :-1], w0, None, idx[:, 1:], 1.0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(hidden=torch.randn(4, 8, dtype=torch.float64).long()), r"`hidden` must be a floating-point"),
        (dict(hidden=torch.randn(4, 8, dtype=torch.float64)),
         r"`hidden` must have the dtype of `weight` \(torch.float32\)"),
        (dict(weight=torch.randn(11, 9)), r"`hidden` must have shape \(\.\.\., H\) with H=9"),
        (dict(weight=torch.randn(11)), r"`weight` must be a floating-point \(V, H\)"),
        (dict(index=torch.zeros(5, dtype=torch.long)), r"`index` must have shape \(4,\)"),
        (dict(index=torch.full((4,), 11)), r"`index` values must lie in \[0, V=11\)"),
        (dict(bias=torch.zeros(10)), r"`bias` must have shape \(11,\)"),
        (dict(temperature=0.0), r"`temperature` must be > 0"),
        (dict(chunk_size=0), r"`chunk_size` must be a positive"),
        (dict(keep_bytes=-1), r"`keep_bytes` must be a number of bytes >= 0"),
    ],
    ids=["int-hidden", "dtype-mismatch", "H-mismatch", "weight-1d", "index-shape", "index-range", "bias-shape",
         "temperature", "chunk", "keep"],
)
def test_chunked_logprobs_bad_input(kwargs, match):
    args = dict(hidden=torch.randn(4, 8), weight=torch.randn(11, 8), index=torch.zeros(4, dtype=torch.long))
    args.update(kwargs)
    hidden, weight, index = args.pop("hidden"), args.pop("weight"), args.pop("index")
    with pytest.raises(ValueError, match=match):
        chunked_logprobs(hidden, weight, index, **args)
