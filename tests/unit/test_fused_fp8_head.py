"""The fused output layer + loss with the output layer in FP8 (--quantize_output_layer --cross_entropy_impl=fused)
against the quantized reference head (fp8_matmul, then the whole-logits loss), and the FP8 amaxes it reports."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mjax.kernels.cross_entropy import cross_entropy_reference
from mjax.kernels.quant.fp8 import Fp8Spec, fp8_matmul
from mjax.kernels.cross_entropy.fused import fused_cross_entropy_sums

B, T, D, V, VOCAB = 2, 64, 128, 256, 250  # the last 6 of 256 logits are vocab padding


def _inputs(vocab_axis, seed=0):
    kh, kw, kt, km = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(kh, (B, T, D), jnp.bfloat16)
    w = jax.random.normal(kw, (V, D) if vocab_axis == 0 else (D, V), jnp.float32) * 0.1
    targets = jax.random.randint(kt, (B, T), 0, VOCAB)
    mask = (jax.random.uniform(km, (B, T)) > 0.2).astype(jnp.float32)
    return h, w, targets, mask


def _fused(vocab_axis, targets, mask, spec, chunk=T):
    def f(h, w, meta):
        return fused_cross_entropy_sums(h, w, targets, mask, vocab_axis=vocab_axis, vocab_size=VOCAB, chunk=chunk,
                                        compute_dtype=jnp.bfloat16, fp8_spec=spec, fp8_meta=meta)[0]
    return f


def _reference(vocab_axis, targets, mask, spec):
    def f(h, w, meta):
        w_dv = w.T if vocab_axis == 0 else w  # [D, V]
        logits = fp8_matmul(h.reshape(-1, D), w_dv, meta, spec).astype(jnp.float32).reshape(B, T, V)
        loss, _ = cross_entropy_reference(logits, targets, vocab_size=VOCAB)
        return jnp.sum(loss * mask)
    return f


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("vocab_axis", [0, 1])
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fused_fp8_head_matches_the_quantized_reference(vocab_axis, recipe):
    h, w, targets, mask = _inputs(vocab_axis)
    spec = Fp8Spec(recipe, "hybrid")
    meta = jnp.array([448 / 4.0, 448 / 0.4, 57344 / 0.5])  # delayed: last step's scales; tensorwise ignores them
    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(h, w, meta)  # noqa: E731
    loss, (dh, dw, amaxes) = grad(_fused(vocab_axis, targets, mask, spec))
    ref_loss, (ref_dh, ref_dw, ref_amaxes) = grad(_reference(vocab_axis, targets, mask, spec))
    _, (bf16_dh, bf16_dw, _) = grad(_fused(vocab_axis, targets, mask, None))
    # The reference rounds its logits to bf16 before the loss: the losses agree to that, the gradients to FP8
    # rounding of the few logit gradients that land on either side of a rounding boundary.
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-3)
    for got, ref, plain in ((dh, ref_dh, bf16_dh), (dw, ref_dw, bf16_dw)):
        assert _rel(got, ref) < 0.01
        assert _rel(plain, ref) > 3 * _rel(got, ref)  # FP8 really ran: the bf16 head is much further off
    # The scales' "gradient": amax of h, of w, of the logits' gradient.
    np.testing.assert_allclose(amaxes[:2], [jnp.max(jnp.abs(h)).astype(jnp.float32), jnp.max(jnp.abs(w))], rtol=0)
    np.testing.assert_allclose(amaxes[2], ref_amaxes[2], rtol=2e-2)


def test_chunks_keep_the_forward_and_move_gradients_within_fp8_rounding():
    """h and w are quantized with whole-tensor scales, so the loss does not depend on the chunking; the logits'
    gradient is scaled per chunk (tensorwise), so the gradients move within FP8 rounding."""
    h, w, targets, mask = _inputs(1, seed=1)
    spec, meta = Fp8Spec("tensorwise", "hybrid"), jnp.ones(3)
    one, (dh1, dw1, a1) = jax.value_and_grad(_fused(1, targets, mask, spec, chunk=T), (0, 1, 2))(h, w, meta)
    four, (dh4, dw4, a4) = jax.value_and_grad(_fused(1, targets, mask, spec, chunk=T // 4), (0, 1, 2))(h, w, meta)
    np.testing.assert_allclose(four, one, rtol=1e-6)
    assert _rel(dh4, dh1) < 0.02 and _rel(dw4, dw1) < 0.02
    np.testing.assert_allclose(a4, a1, rtol=1e-6)  # the max over chunks is the whole tensor's amax


def test_only_per_tensor_recipes_reach_the_fused_fp8_head():
    """A blockwise or FP4 policy must not quietly run as tensorwise inside the fused loss."""
    from mjax.kernels.quant import QuantPolicy, per_tensor_spec  # noqa: PLC0415

    assert per_tensor_spec(QuantPolicy(fp8_recipe="delayed")).recipe == "delayed"
    for policy in (QuantPolicy(fp8_recipe="blockwise"), QuantPolicy(fp4_recipe="nvfp4")):
        with pytest.raises(ValueError, match="delayed|tensorwise"):
            per_tensor_spec(policy)
