"""Output layer + cross-entropy fused and chunked: the [tokens, vocab] logits exist one sequence chunk at a time,
never whole, and the backward costs no recomputation.

Each chunk's forward pass also computes that chunk's gradients (softmax - one-hot is known as soon as the log-sum-
exp is), so the forward does the logits GEMM plus the two gradient GEMMs, exactly the FLOPs of an unfused forward +
backward, while the peak memory is one chunk of fp32 logits instead of all of them (at 32768 tokens x 128256 vocab,
16.8 GB). The result is the *sum* over unmasked tokens, as the train step needs it; its backward scales the saved
gradients by the incoming cotangent. The z-loss sum is returned for logging only: its cotangent is ignored.

With an Fp8Spec (--quantize_output_layer, per-tensor recipes) the three GEMMs run in FP8 like any quantized
linear layer (kernels/quant/fp8.py): h and w with whole-tensor scales, the logits' gradient with a scale per chunk
(tensorwise: that chunk's amax, finer than one scale for all tokens; delayed: the history's). The FP8 scales'
"gradient" is the observed amaxes of (h, w, logits' gradient over all chunks), as in `fp8_matmul`.
"""

import functools

import jax
import jax.numpy as jnp

from mjax.kernels.quant import fp8
from mjax.kernels.cross_entropy.reference import mask_vocab_padding, token_losses


def fused_cross_entropy_sums(h, w, targets, mask, *, vocab_axis: int, vocab_size: int, z_loss_coeff: float = 0.0,
                             chunk: int = 1024, compute_dtype=jnp.bfloat16, fp8_spec: fp8.Fp8Spec | None = None,
                             fp8_meta=None):
    """h [B, T, D]; w [V, D] (vocab_axis 0, a tied embedding) or [D, V] (vocab_axis 1); targets [B, T] int;
    mask [B, T] float; with fp8_spec, fp8_meta [3] the output layer's FP8 scales. Returns (sum of masked
    per-token losses incl. z-loss, sum of masked log Z^2)."""
    meta = jnp.ones((3,), jnp.float32) if fp8_meta is None else fp8_meta
    return _fused(h, w, targets, mask, meta, vocab_axis, vocab_size, float(z_loss_coeff), int(chunk),
                  jnp.dtype(compute_dtype), fp8_spec)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _fused(h, w, targets, mask, meta, vocab_axis, vocab_size, z_coeff, chunk, dtype, spec):
    return _forward(h, w, targets, mask, meta, vocab_axis, vocab_size, z_coeff, chunk, dtype, spec)[0]


def _chunks(x, chunk):
    """[B, T, ...] -> [T / chunk, B, chunk, ...]: scanned over sequence chunks, so a batch split over devices stays
    split (scanning a sharded axis would gather it)."""
    b, t = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, t // chunk, chunk, *x.shape[2:]), 1, 0)


def _bf16_gemms(w, vocab_axis, dtype):
    """The GEMMs of one chunk in compute dtype: logits(hb [B, c, D]) -> (f32 [B, c, V], what the gradients reuse);
    grads(that, dlogits [B, c, V]) -> (dh [B, c, D], dw, amax of dlogits: 0, nothing observes it)."""
    wc = w.astype(dtype)
    logits_eq, dh_eq, dw_eq = (("bcd,vd->bcv", "bcv,vd->bcd", "bcd,bcv->vd") if vocab_axis == 0
                               else ("bcd,dv->bcv", "bcv,dv->bcd", "bcd,bcv->dv"))

    def logits(hb):
        hc = hb.astype(dtype)
        return jnp.einsum(logits_eq, hc, wc, preferred_element_type=jnp.float32), hc

    def grads(hc, dlogits):
        dlogits = dlogits.astype(dtype)
        return (jnp.einsum(dh_eq, dlogits, wc, preferred_element_type=jnp.float32),
                jnp.einsum(dw_eq, hc, dlogits, preferred_element_type=jnp.float32), 0.0)
    return logits, grads


def _fp8_gemms(h, w, meta, vocab_axis, dtype, spec):
    """The same GEMMs in FP8, every operand K-major (fp8.both_layouts), w quantized from its own (master) dtype,
    each chunk's h quantized once for the logits and the weight gradient; also returns the amaxes of h and w."""
    fwd_dt, grad_dt = spec.dtypes
    ah = fp8.amax(h)  # h is quantized chunk by chunk with the whole tensor's scale
    sh = fp8.gemm_scale(spec, meta, ah, fp8.META_X, fwd_dt)
    w_dv = w.T if vocab_axis == 0 else w  # [D, V]
    wq_dv, wq_vd, sw, aw = fp8.quantize_operand(w_dv, spec, meta, fp8.META_W, fwd_dt)  # [D, V] dh, [V, D] logits

    def logits(hb):
        b, c, d = hb.shape
        hq, hq_t = fp8.both_layouts(hb.astype(dtype).reshape(b * c, d), sh, fwd_dt, spec)  # [B c, D], [D, B c]
        out = fp8.scaled_dot(hq, wq_vd, (1, 1), 1.0 / (sh * sw), jnp.float32)  # [B c, V]
        return out.reshape(b, c, -1), hq_t

    def grads(hq_t, dlogits):
        b, c, v = dlogits.shape
        g = dlogits.reshape(b * c, v)  # f32
        gq, gq_t, sg, ag = fp8.quantize_operand(g, spec, meta, fp8.META_G, grad_dt)  # [B c, V], [V, B c]
        dh = fp8.scaled_dot(gq, wq_dv, (1, 1), 1.0 / (sg * sw), jnp.float32).reshape(b, c, -1)
        pair = (gq_t, hq_t) if vocab_axis == 0 else (hq_t, gq_t)  # dw [V, D] or [D, V], contracting tokens
        dw = fp8.scaled_dot(*pair, (1, 1), 1.0 / (sh * sg), jnp.float32)
        return dh, dw, ag
    return logits, grads, ah, aw


def _forward(h, w, targets, mask, meta, vocab_axis, vocab_size, z_coeff, chunk, dtype, spec):
    b, t, d = h.shape
    chunk = min(chunk, t)
    pad = -t % chunk
    if pad:  # padded positions carry mask 0
        h, targets, mask = (jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in (h, targets, mask))
    if spec is None:
        logits_gemm, grad_gemms = _bf16_gemms(w, vocab_axis, dtype)
        ah = aw = jnp.zeros((), jnp.float32)
    else:
        logits_gemm, grad_gemms, ah, aw = _fp8_gemms(h, w, meta, vocab_axis, dtype, spec)

    def body(carry, xs):
        dw, ag = carry
        hb, tb, mb = xs  # [B, c, D], [B, c], [B, c]
        logits, operand = logits_gemm(hb)  # [B, c, V] f32, the chunk's h as the weight gradient reads it
        logits = mask_vocab_padding(logits, vocab_size)
        loss, lse = token_losses(logits, tb, z_coeff)  # [B, c]
        probs = jnp.exp(logits - lse[..., None])
        # d(loss)/d(logits) = softmax - one-hot (+ 2 z lse softmax), for unmasked tokens only
        vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
        dlogits = (probs * (1.0 + 2.0 * z_coeff * lse[..., None]) - (vocab_ids == tb[..., None])) * mb[..., None]
        dh, dw_chunk, ag_chunk = grad_gemms(operand, dlogits)
        return (dw + dw_chunk, jnp.maximum(ag, ag_chunk)), (jnp.sum(loss * mb), jnp.sum(jnp.square(lse) * mb),
                                                            dh.astype(h.dtype))

    (dw, ag), (loss_sums, z_sums, dh) = jax.lax.scan(
        body, (jnp.zeros(w.shape, jnp.float32), jnp.zeros((), jnp.float32)),
        (_chunks(h, chunk), _chunks(targets, chunk), _chunks(mask, chunk)))
    dh = jnp.moveaxis(dh, 0, 1).reshape(b, t + pad, d)[:, :t]  # [B, T, D]
    amaxes = jnp.stack([ah, aw, ag])  # the FP8 scales' "gradient" (zeros unquantized)
    return (jnp.sum(loss_sums), jnp.sum(z_sums)), (dh, dw.astype(w.dtype), amaxes)


def _fused_fwd(h, w, targets, mask, meta, vocab_axis, vocab_size, z_coeff, chunk, dtype, spec):
    return _forward(h, w, targets, mask, meta, vocab_axis, vocab_size, z_coeff, chunk, dtype, spec)


def _fused_bwd(vocab_axis, vocab_size, z_coeff, chunk, dtype, spec, residuals, cotangents):
    dh, dw, amaxes = residuals
    g = cotangents[0]  # the z sum is a metric: its cotangent is dropped
    return (dh * g.astype(dh.dtype), dw * g.astype(dw.dtype), None, None, amaxes)


_fused.defvjp(_fused_fwd, _fused_bwd)
