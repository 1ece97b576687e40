"""Memory-lean log-probability kernels for policy-gradient and preference training.

Every trainer needs ``log p(token | context)`` for the sampled tokens, and the naive
``logits.log_softmax(-1).gather(-1, index)`` materialises a second full ``(B, T, V)`` tensor (plus a third in
backward) just to read ``B * T`` numbers out of it. The functions here compute the same values while only ever
holding a budget-sized chunk of rows:

- :func:`selective_log_softmax` - ``log_softmax(logits)[index]`` from logits you already have;
- :func:`chunked_logprobs` - the same from the last hidden states and the lm-head weight, so the ``(N, V)``
  logits never exist for all tokens at once;
- :func:`entropy_from_logits` - per-row entropy of ``softmax(logits)``.

All three are vectorised over chunks of rows and have hand-written backward passes that recompute each chunk's
softmax, instead of letting autograd keep one intermediate per chunk alive. Only torch is imported.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.autograd.function import once_differentiable

__all__ = [
    "DEFAULT_CPU_CHUNK_BYTES",
    "DEFAULT_CPU_KEEP_BYTES",
    "DEFAULT_GPU_CHUNK_BYTES",
    "DEFAULT_GPU_KEEP_BYTES",
    "chunked_logprobs",
    "entropy_from_logits",
    "selective_log_softmax",
]

# Budget for one chunk's working tensor. On CPU a small, cache-friendly chunk in a reused
# buffer is *faster* than the full-size naive op (`python -m benchmarks kernels`), so
# the budget is small. On accelerators every chunk costs a few kernel launches, so a
# larger budget keeps the launch overhead negligible while still being a small fraction
# of a full (B, T, V) tensor.
DEFAULT_CPU_CHUNK_BYTES = 16 * 2**20
DEFAULT_GPU_CHUNK_BYTES = 256 * 2**20
# Budget for the log-softmax rows `chunked_logprobs` keeps from its forward for its backward (which then skips
# recomputing their logits, a (rows, V, H) matmul). On CPU that matmul is a sixth of the head's work and a
# kept float32 row costs 4 V bytes (192 KiB at V = 49k); accelerators keep memory for batch size instead.
DEFAULT_CPU_KEEP_BYTES = 256 * 2**20
DEFAULT_GPU_KEEP_BYTES = 0

_HALF_DTYPES = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------- helpers


def _default_chunk_bytes(device: torch.device) -> int:
    return DEFAULT_CPU_CHUNK_BYTES if device.type == "cpu" else DEFAULT_GPU_CHUNK_BYTES


def _default_keep_bytes(device: torch.device) -> int:
    return DEFAULT_CPU_KEEP_BYTES if device.type == "cpu" else DEFAULT_GPU_KEEP_BYTES


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision the softmax is carried out in: half types are upcast to float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows_per_chunk(vocab: int, dtype: torch.dtype, chunk_bytes: int) -> int:
    """Rows per chunk so that one (rows, V) tensor in working precision fits the budget."""
    return max(1, chunk_bytes // max(1, vocab * _work_dtype(dtype).itemsize))


def _row_blocks(t: torch.Tensor) -> list[torch.Tensor]:
    """Split ``t: (..., V)`` into 2-D ``(rows, V)`` views covering its rows in row-major order.

    ``logits[:, :-1]`` (the usual "shift by one" slice) cannot be viewed as ``(-1, V)``;
    ``reshape`` would silently copy the whole tensor, defeating the point of chunking.
    Instead we recurse over the leading dimension until the pieces are viewable, which
    costs one Python iteration per batch row at most, never one per token.
    """
    if t.dim() == 1:
        return [t.unsqueeze(0)]
    try:
        return [t.view(-1, t.shape[-1])]
    except RuntimeError:
        return [block for sub in t.unbind(0) for block in _row_blocks(sub)]


def _row_chunks(t: torch.Tensor, rows: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(row_offset, chunk: (n <= rows, V))`` views over the rows of ``t: (..., V)``."""
    offset = 0
    for block in _row_blocks(t):
        for start in range(0, block.shape[0], rows):
            yield offset + start, block[start : start + rows]
        offset += block.shape[0]


def _scratch(t: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """A ``(min(rows, R), V)`` buffer for chunks of ``t: (..., V)`` with R rows in total."""
    total = t.numel() // max(1, t.shape[-1])
    return torch.empty((min(rows, total), t.shape[-1]), dtype=dtype, device=t.device)


def _scatter_add_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.scatter_add_(-1, index, src)`` for a contiguous ``dst: (n, V)``, ``index, src: (n, K)``.

    On CPU, ``scatter_add_`` into a float16/bfloat16 tensor upcasts the *whole* destination
    to float32 and back (a ~15x slowdown per chunk); ``index_add_`` on the flat view touches
    only the n*K target elements. Duplicate indices in a row still accumulate.
    """
    if dst.dtype not in _HALF_DTYPES:
        return dst.scatter_add_(-1, index, src)
    flat = index + torch.arange(dst.shape[0], device=dst.device)[:, None] * dst.shape[1]
    dst.view(-1).index_add_(0, flat.view(-1), src.reshape(-1).to(dst.dtype))
    return dst


def _check_logits(logits: object, name: str = "logits") -> torch.Tensor:
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"`{name}` must be a torch.Tensor of shape (..., V); got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise ValueError(f"`{name}` must be a floating-point tensor of shape (..., V); got dtype {logits.dtype}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"`{name}` must have shape (..., V) with V >= 1; got shape {tuple(logits.shape)}")
    return logits


def _check_index(index: object, vocab: int, name: str = "index") -> torch.Tensor:
    if not isinstance(index, torch.Tensor):
        raise ValueError(f"`{name}` must be an integer torch.Tensor; got {type(index).__name__}")
    if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
        raise ValueError(f"`{name}` must be an integer tensor (torch.long); got dtype {index.dtype}")
    # An out-of-range index is a RuntimeError on CPU and a device-side assert (which kills
    # the CUDA context) on GPU; a clear ValueError up front is worth one reduction.
    if index.numel() > 0:
        lo, hi = int(index.min()), int(index.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"`{name}` values must lie in [0, V={vocab}); got min={lo}, max={hi}")
    return index.long()


# --------------------------------------------------------------- selective_log_softmax


class _SelectiveLogSoftmax(torch.autograd.Function):
    """``out = log_softmax(logits)[..., index]`` over 2-D row chunks; index is (..., K)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
        k = index.shape[-1]
        out = torch.empty(index.shape, dtype=logits.dtype, device=logits.device)
        out2, idx2 = out.view(-1, k), index.view(-1, k)
        # One scratch buffer reused by every chunk: on CPU a fresh multi-MB allocation per
        # chunk costs more in page faults than the log-softmax itself.
        buf = _scratch(logits, rows, logits.dtype)
        for off, chunk in _row_chunks(logits, rows):
            n = chunk.shape[0]
            # Per-chunk log_softmax, then gather. For float16/bfloat16 this is the only way
            # to be bit-identical to the naive op (a half-precision logsumexp loses digits);
            # for float32/64 it is also exact and, on CPU, faster than the "gather minus
            # chunked logsumexp" route: log_softmax is one fused pass, logsumexp is four.
            logp = torch.log_softmax(chunk, -1, out=buf[:n])
            torch.gather(logp, -1, idx2[off : off + n], out=out2[off : off + n])
        ctx.rows = rows
        ctx.save_for_backward(logits, index)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        logits, index = ctx.saved_tensors
        vocab, k = logits.shape[-1], index.shape[-1]
        # d out_k / d logits = onehot(index_k) - softmax(logits), so per row
        # grad = scatter(grad_out) - softmax * sum_k grad_out_k. The gradient itself is
        # full size (unavoidable); everything else is one chunk at a time.
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad2 = grad.view(-1, vocab)
        gout2, idx2 = grad_out.reshape(-1, k), index.view(-1, k)
        for off, chunk in _row_chunks(logits, ctx.rows):
            n = chunk.shape[0]
            g = gout2[off : off + n]
            # Softmax written straight into the gradient slice: no temporary at all. For
            # half types the fused kernel accumulates in float32 and rounds once (mul_ adds
            # a second rounding, the same order as the naive backward's, which rounds the
            # log-softmax before exponentiating it); `softmax(..., dtype=float32)` would
            # copy every chunk to float32 behind our back: slower and an extra allocation.
            p = torch.softmax(chunk, -1, out=grad2[off : off + n])
            _scatter_add_rows(p.mul_(-g.sum(-1, keepdim=True)), idx2[off : off + n], g)
        return grad, None, None


def selective_log_softmax(
    logits: torch.Tensor,
    index: torch.Tensor,
    *,
    chunk_bytes: int | None = None,
) -> torch.Tensor:
    """Log-softmax of ``logits`` read at ``index``, without a full-size log-softmax.

    Equal to ``torch.gather(logits.log_softmax(-1), -1, index)`` with the index given
    one of two shapes:

    - ``index: (...)`` (``index.ndim == logits.ndim - 1``): one token per row, the usual
      "log-prob of the sampled token"; output ``(...)``.
    - ``index: (..., K)`` (``index.ndim == logits.ndim``): K tokens per row (e.g. top-k or
      candidate tokens); output ``(..., K)``.

    Args:
        logits: ``(..., V)`` floating tensor, any float dtype. May be a non-contiguous
            slice such as ``logits[:, :-1]``; it is never copied.
        index: ``(...)`` or ``(..., K)`` integer tensor with values in ``[0, V)``.
        chunk_bytes: memory budget for one chunk's working tensor, counted at 4 bytes
            per element (8 for float64): ``chunk_bytes // (V * 4)`` rows at a time.
            Defaults to 16 MiB on CPU (cache-sized, faster than naive) and 256 MiB on
            accelerators (few kernel launches).

    Returns:
        ``index.shape`` tensor of the logits' dtype. Values are bit-identical to the naive
        computation (the same row-wise log_softmax kernel runs on each chunk, and
        chunking changes no row's arithmetic); the tests pin this for float16/bfloat16
        and require float32/64 to be within 1e-5. Gradients w.r.t. ``logits`` equal the
        naive ones up to float rounding (float32: within 1e-5).

    Memory: forward holds one chunk of log-softmax; backward allocates the gradient
    (which is full size by definition) and writes the softmax for each chunk directly
    into it, so no other full-size tensor is ever alive.

    Raises:
        ValueError: non-floating ``logits``, an ``index`` of the wrong shape or dtype, or
            values outside ``[0, V)``.
    """
    logits = _check_logits(logits)
    if not isinstance(index, torch.Tensor):
        raise ValueError(f"`index` must be an integer torch.Tensor; got {type(index).__name__}")
    lead = tuple(logits.shape[:-1])
    if index.dim() == logits.dim() - 1 and tuple(index.shape) == lead:
        squeeze = True
        index = index.unsqueeze(-1)
    elif index.dim() == logits.dim() and tuple(index.shape[:-1]) == lead:
        squeeze = False
    else:
        raise ValueError(
            f"`index` must have shape {lead} (one token per row) or {lead + ('K',)} "
            f"(K tokens per row) to match logits of shape {tuple(logits.shape)}; "
            f"got {tuple(index.shape)}"
        )
    index = _check_index(index, logits.shape[-1]).contiguous()
    if chunk_bytes is None:
        chunk_bytes = _default_chunk_bytes(logits.device)
    if chunk_bytes <= 0:
        raise ValueError(f"`chunk_bytes` must be a positive number of bytes; got {chunk_bytes}")
    rows = _rows_per_chunk(logits.shape[-1], logits.dtype, chunk_bytes)
    out = _SelectiveLogSoftmax.apply(logits, index, rows)
    return out.squeeze(-1) if squeeze else out


# ----------------------------------------------------------------- entropy_from_logits


def _log_softmax_into(chunk, out, scratch):
    """``out[:] = log_softmax(chunk)`` in ``out``'s (float32/64) precision.

    Half-precision chunks are first upcast into ``scratch`` explicitly: passing
    ``dtype=torch.float32`` to log_softmax would allocate that copy on every call.
    """
    if chunk.dtype != out.dtype:
        chunk = scratch.copy_(chunk)
    return torch.log_softmax(chunk, -1, out=out)


class _EntropyFromLogits(torch.autograd.Function):
    """``H = -sum softmax(z) * log_softmax(z)`` per row of ``z: (..., V)``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, rows: int) -> torch.Tensor:
        work = _work_dtype(logits.dtype)
        ent = torch.empty(logits.shape[:-1], dtype=work, device=logits.device)
        ent1 = ent.view(-1)
        logp_buf, p_buf = _scratch(logits, rows, work), _scratch(logits, rows, work)
        for off, chunk in _row_chunks(logits, rows):
            n = chunk.shape[0]
            logp = _log_softmax_into(chunk, logp_buf[:n], p_buf[:n])
            p = torch.exp(logp, out=p_buf[:n])
            torch.sum(p.mul_(logp), -1, out=ent1[off : off + n]).neg_()
        ctx.rows = rows
        ctx.save_for_backward(logits, ent)
        return ent.to(logits.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        logits, ent = ctx.saved_tensors
        work, vocab = ent.dtype, logits.shape[-1]
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad2 = grad.view(-1, vocab)
        g1, ent1 = grad_out.reshape(-1).to(work), ent.view(-1)
        # float32/64: build the gradient in place inside `grad`; half: in a float32 buffer.
        logp_buf = None if logits.dtype == work else _scratch(logits, ctx.rows, work)
        p_buf = _scratch(logits, ctx.rows, work)
        for off, chunk in _row_chunks(logits, ctx.rows):
            n = chunk.shape[0]
            dst = grad2[off : off + n] if logp_buf is None else logp_buf[:n]
            # dH/dz = -p * (log p + H)
            logp = _log_softmax_into(chunk, dst, p_buf[:n])
            p = torch.exp(logp, out=p_buf[:n])
            logp.add_(ent1[off : off + n, None]).mul_(p).mul_(-g1[off : off + n, None])
            if logp_buf is not None:
                grad2[off : off + n] = logp
        return grad, None


def entropy_from_logits(
    logits: torch.Tensor,
    chunk_size: int | None = None,
    *,
    chunk_bytes: int | None = None,
) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per row, computed chunk by chunk.

    Args:
        logits: ``(..., V)`` floating tensor (may be a non-contiguous slice).
        chunk_size: rows per chunk. ``None`` derives it from ``chunk_bytes`` (same
            defaults as :func:`selective_log_softmax`).
        chunk_bytes: budget for one chunk's float32 working tensor when ``chunk_size``
            is ``None``.

    Returns:
        ``(...)`` tensor of the logits' dtype. Half-precision inputs are evaluated in
        float32 and rounded once, so they are *more* accurate than the naive half op.
        Differentiable; backward recomputes each chunk's softmax.

    Raises:
        ValueError: non-floating ``logits`` or a non-positive chunk size.
    """
    logits = _check_logits(logits)
    if chunk_size is None:
        if chunk_bytes is None:
            chunk_bytes = _default_chunk_bytes(logits.device)
        if chunk_bytes <= 0:
            raise ValueError(f"`chunk_bytes` must be a positive number of bytes; got {chunk_bytes}")
        chunk_size = _rows_per_chunk(logits.shape[-1], logits.dtype, chunk_bytes)
    if chunk_size <= 0:
        raise ValueError(f"`chunk_size` must be a positive number of rows; got {chunk_size}")
    return _EntropyFromLogits.apply(logits, chunk_size)


# -------------------------------------------------------------------- chunked_logprobs


def _chunk_logits(h, weight, bias, temperature, out, low):
    """``out[:] = (h @ weight.T + bias) / temperature`` for one chunk, without allocating.

    ``h: (n, H)``, ``weight: (V, H)``, ``out: (n, V)`` in the softmax precision. The
    matmul runs in the model's dtype (what ``lm_head`` does); for half-precision heads it
    lands in ``low: (n, V)`` and is upcast into ``out``, exactly like the logits path's
    ``lm_head(h).float()``.
    """
    target = out if low is None else low
    if bias is None:
        torch.mm(h, weight.t(), out=target)
    else:
        torch.addmm(bias, h, weight.t(), out=target)
    if low is not None:
        out.copy_(low)
    if temperature != 1.0:
        out.div_(temperature)
    return out


class _ChunkedLogprobs(torch.autograd.Function):
    """Log-probs (and optionally entropy) of ``softmax((hidden @ weight.T + bias) / T)``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, index, temperature, chunk_size, return_entropy, keep_bytes):
        # hidden: (N, H), weight: (V, H), bias: (V,) | None, index: (N,) long
        work = _work_dtype(weight.dtype)
        n_rows, vocab = hidden.shape[0], weight.shape[0]
        rows = min(chunk_size, max(1, n_rows))
        logp = torch.empty(n_rows, dtype=work, device=hidden.device)
        ent = torch.empty(n_rows, dtype=work, device=hidden.device) if return_entropy else None
        kept = _kept_rows(n_rows, rows, vocab, work, keep_bytes) if any(ctx.needs_input_grad[:3]) else 0
        # The first `kept` rows' log-softmax stays for the backward (no recomputed logits there); the other
        # chunks reuse one (rows, V) buffer. Plus one buffer for the logits (and one in the model dtype for
        # half heads): the working set beyond the kept rows is independent of N.
        lp_kept = torch.empty(kept, vocab, dtype=work, device=hidden.device)
        z_buf = torch.empty(rows, vocab, dtype=work, device=hidden.device)
        s_buf = torch.empty(rows if kept < n_rows else 0, vocab, dtype=work, device=hidden.device)
        low = None if weight.dtype == work else torch.empty(rows, vocab, dtype=weight.dtype, device=hidden.device)
        for s in range(0, n_rows, rows):
            e = min(s + rows, n_rows)
            n = e - s
            z = _chunk_logits(hidden[s:e], weight, bias, temperature, z_buf[:n], None if low is None else low[:n])
            lp = torch.log_softmax(z, -1, out=lp_kept[s:e] if e <= kept else s_buf[:n])
            torch.gather(lp, -1, index[s:e, None], out=logp[s:e, None])
            if ent is not None:
                p = torch.exp(lp, out=z)
                torch.sum(p.mul_(lp), -1, out=ent[s:e]).neg_()
        ctx.temperature = temperature
        ctx.rows = rows
        ctx.save_for_backward(hidden, weight, bias, index, ent, lp_kept)
        ctx.set_materialize_grads(False)
        return (logp, ent) if return_entropy else logp

    @staticmethod
    @once_differentiable
    def backward(ctx, g_logp, g_ent=None):
        hidden, weight, bias, index, ent, lp_kept = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if (g_logp is None and g_ent is None) or not (need_h or need_w or need_b):
            return None, None, None, None, None, None, None, None
        temperature, rows, kept = ctx.temperature, ctx.rows, lp_kept.shape[0]
        work = _work_dtype(weight.dtype)
        n_rows, vocab = hidden.shape[0], weight.shape[0]
        half = weight.dtype != work
        if g_logp is not None:
            g_logp = g_logp.to(work)
        if g_ent is not None:
            g_ent = g_ent.to(work)

        grad_h = torch.empty_like(hidden) if need_h else None
        # Summing the weight gradient chunk by chunk in bfloat16 would lose the float32
        # accumulation one big matmul gets internally, so half-precision heads get a
        # float32 accumulator (V * H * 4 bytes, far below one (N, V) logits tensor).
        grad_w = torch.zeros(weight.shape, dtype=work, device=weight.device) if need_w else None
        w_part = torch.empty_like(weight) if (need_w and half) else None
        grad_b = torch.zeros(vocab, dtype=work, device=weight.device) if need_b else None
        z_buf = torch.empty(rows, vocab, dtype=work, device=hidden.device)
        s_buf = torch.empty(rows if kept < n_rows or g_ent is not None else 0, vocab, dtype=work,
                            device=hidden.device)
        low = torch.empty(rows, vocab, dtype=weight.dtype, device=hidden.device) if half else None

        for s in range(0, n_rows, rows):
            e = min(s + rows, n_rows)
            n, h = e - s, hidden[s:e]
            if e <= kept:  # the forward's log-softmax: p = exp(log p), no logits to recompute
                lp = lp_kept[s:e]
                p = torch.exp(lp, out=z_buf[:n])
                lp = torch.add(lp, ent[s:e, None], out=s_buf[:n]) if g_ent is not None else None
            else:
                # Recompute this chunk's logits instead of having stored them: one extra
                # matmul buys never holding (N, V).
                z = _chunk_logits(h, weight, bias, temperature, z_buf[:n], None if low is None else low[:n])
                if g_ent is None:
                    p, lp = torch.softmax(z, -1, out=s_buf[:n]), None
                else:
                    lp = torch.log_softmax(z, -1, out=s_buf[:n])
                    p = torch.exp(lp, out=z)
                    lp.add_(ent[s:e, None])
            if g_ent is None:
                # d logp_i / dz = onehot(i) - p
                gz = p.mul_(-g_logp[s:e, None])
            else:
                # dH/dz = -p * (log p + H); d logp_i / dz = onehot(i) - p   (lp holds log p + H here)
                gz = lp.mul_(p).mul_(-g_ent[s:e, None])
                if g_logp is not None:
                    gz.addcmul_(p, g_logp[s:e, None], value=-1.0)
            if g_logp is not None:
                gz.scatter_add_(-1, index[s:e, None], g_logp[s:e, None])
            if temperature != 1.0:
                gz.div_(temperature)
            if need_b:
                grad_b.add_(gz.sum(0))
            if half:
                gz = low[:n].copy_(gz)  # matches the cast-back of the logits path's `.float()`
            if need_h:
                torch.mm(gz, weight, out=grad_h[s:e])
            if need_w:
                if half:
                    grad_w.add_(torch.mm(gz.t(), h, out=w_part))
                else:
                    grad_w.addmm_(gz.t(), h)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _kept_rows(n_rows: int, rows: int, vocab: int, work: torch.dtype, keep_bytes: int) -> int:
    """Rows whose log-softmax the forward keeps for the backward: all N when they fit `keep_bytes`, else whole
    chunks of `rows` up to it."""
    fits = keep_bytes // max(1, vocab * work.itemsize)
    return n_rows if fits >= n_rows else fits // rows * rows


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    index: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    return_entropy: bool = False,
    keep_bytes: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs straight from the last hidden states, never building all logits.

    Computes ``log_softmax((hidden @ weight.T + bias).float() / temperature)[index]``
    ``chunk_size`` rows at a time, with its own backward that recomputes each chunk's
    logits, so neither pass ever holds the ``(N, V)`` logits (or their gradient). Up to
    ``keep_bytes`` of the forward's log-softmax rows are kept for the backward instead, which then
    skips their logits' matmul.

    Args:
        hidden: ``(N, H)`` or ``(..., H)`` final hidden states (after the final norm),
            any float dtype. Leading dims are flattened internally.
        weight: ``(V, H)`` lm-head weight (``model.lm_head.weight``).
        index: ``(N,)`` / ``(...)`` integer token ids in ``[0, V)``, one per hidden row
            (for next-token log-probs: hidden[:, :-1] with input_ids[:, 1:]).
        bias: optional ``(V,)`` lm-head bias.
        temperature: sampling temperature; logits are divided by it before the softmax.
        chunk_size: rows per chunk; ``None`` picks ``max(1, 2**26 // (4 * V))`` (a 64 MiB
            float32 logits chunk, 512 rows at V = 32k).
        return_entropy: also return the entropy of each row's distribution.
        keep_bytes: when gradients are needed, the log-softmax of the first rows (all N when they fit)
            that the forward keeps for the backward, in working-precision bytes; ``None``: 256 MiB on
            CPU, where the matmul it saves is most of the head's backward and memory is plentiful, 0 on
            accelerators (every chunk recomputed).

    Returns:
        ``logprobs: (...)`` in float32 (float64 if an input is float64), and with
        ``return_entropy=True`` a tuple ``(logprobs, entropy)`` of the same shape.
        Gradients flow to ``hidden``, ``weight`` and ``bias``.

    When trainers must fall back to the logits path (``model(...).logits`` followed by
    :func:`selective_log_softmax`): this function assumes the logits are *exactly*
    ``hidden @ weight.T (+ bias)``. That is false for

    - models with final logit soft-capping (Gemma 2/3: ``tanh(logits / c) * c``);
    - models with a final logit scale or multiplier (Cohere ``logit_scale``, Granite
      ``logits_scaling``, MiniCPM/muP width scaling) unless you fold it into
      ``temperature`` yourself;
    - quantized heads (bitsandbytes/GPTQ/AWQ ``Linear4bit``...), whose ``.weight`` is not
      a dense float matrix, and LoRA or other adapters placed on ``lm_head`` (the
      adapter's delta is not in ``weight``);
    - any lm_head that is not a plain ``nn.Linear`` (multi-head/MTP heads, value heads
      with extra layers, tensor-parallel or DTensor-sharded heads, FSDP-flattened
      parameters that are not gathered in this scope);
    - models whose ``forward`` post-processes the logits (e.g. masking or padding of the
      vocabulary to a multiple of 64 handled outside the head).

    Tied embeddings are fine when ``weight`` is the shared embedding matrix (gradients
    accumulate into it like they would through the head), as long as none of the above
    applies.

    Raises:
        ValueError: shape or dtype mismatches among ``hidden``, ``weight``, ``bias`` and
            ``index``, indices out of range, or a non-positive temperature/chunk size.
    """
    _check_logits(hidden, "hidden")
    if hidden.dim() < 2:
        raise ValueError(f"`hidden` must have shape (N, H) or (..., H); got shape {tuple(hidden.shape)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        got = (f"shape {tuple(weight.shape)}, dtype {weight.dtype}" if isinstance(weight, torch.Tensor)
               else type(weight).__name__)
        raise ValueError(f"`weight` must be a floating-point (V, H) tensor; got {got}")
    vocab, width = weight.shape
    if hidden.dtype != weight.dtype:
        raise ValueError(
            f"`hidden` must have the dtype of `weight` ({weight.dtype}), as lm_head would require; "
            f"got {hidden.dtype}"
        )
    if hidden.shape[-1] != width:
        raise ValueError(
            f"`hidden` must have shape (..., H) with H={width} to match weight (V={vocab}, H={width}); "
            f"got {tuple(hidden.shape)}"
        )
    if bias is not None and (
        not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (vocab,) or bias.dtype != weight.dtype
    ):
        got = (f"shape {tuple(bias.shape)}, dtype {bias.dtype}" if isinstance(bias, torch.Tensor)
               else type(bias).__name__)
        raise ValueError(f"`bias` must have shape ({vocab},) and dtype {weight.dtype} to match weight; got {got}")
    if not isinstance(index, torch.Tensor) or tuple(index.shape) != tuple(hidden.shape[:-1]):
        got = tuple(index.shape) if isinstance(index, torch.Tensor) else type(index).__name__
        raise ValueError(f"`index` must have shape {tuple(hidden.shape[:-1])} (hidden without H); got {got}")
    index = _check_index(index, vocab)
    if not temperature > 0:
        raise ValueError(f"`temperature` must be > 0; got {temperature}")
    if chunk_size is None:
        chunk_size = max(1, 2**26 // (4 * vocab))
    if chunk_size <= 0:
        raise ValueError(f"`chunk_size` must be a positive number of rows; got {chunk_size}")
    if keep_bytes is not None and keep_bytes < 0:
        raise ValueError(f"`keep_bytes` must be a number of bytes >= 0; got {keep_bytes}")

    lead = index.shape
    out = _ChunkedLogprobs.apply(
        hidden.reshape(-1, width),  # copies only (N, H) if non-viewable, never (N, V)
        weight,
        bias,
        index.reshape(-1),
        float(temperature),
        int(chunk_size),
        bool(return_entropy),
        int(_default_keep_bytes(hidden.device) if keep_bytes is None else keep_bytes),
    )
    if return_entropy:
        logp, ent = out
        return logp.view(lead), ent.view(lead)
    return out.view(lead)
