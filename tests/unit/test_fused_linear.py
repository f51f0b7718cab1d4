"""Fused projections (one GEMM for QKV and for gate/up) against the separate Linears they replace."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mjax.config import load_config
from mjax.kernels.quant.fp8 import Fp8Spec, fp8_matmul
from mjax.kernels.quant import QuantPolicy
from mjax.model.attention import Attention
from mjax.model.layers import Fp8Meta, Linear, fused_linear
from mjax.kernels.swiglu import swiglu_pairs
from mjax.model.mlp import MLP
from mjax.model.rope import apply_rope, rope_frequencies


def _model_cfg(**kw):
    return load_config("tiny").replace(model=dict(hidden_size=64, num_attention_heads=8, num_query_groups=2,
                                                  ffn_hidden_size=96, add_qkv_bias=True, **kw)).model


def _x(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


@pytest.mark.slow  # compile-heavy: several programs (or a train step) compiled
def test_fused_qkv_matches_the_separate_projections_and_their_gradients():
    cfg = _model_cfg()
    attn = Attention(cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    for p in (attn.q_proj, attn.k_proj, attn.v_proj):  # nonzero biases, so a misplaced bias shows
        p.bias[...] = _x(p.bias.shape, seed=p.kernel.shape[-2])
    x, pos = _x((2, 16, 64), 1), jnp.broadcast_to(jnp.arange(16), (2, 16))
    inv_freq = rope_frequencies(cfg)

    def separate(a, x):
        return (apply_rope(a.q_proj(x), pos, inv_freq), apply_rope(a.k_proj(x), pos, inv_freq), a.v_proj(x))

    def loss(fn, a, x):  # weights every output element differently
        return sum(jnp.sum(t * jnp.cos(jnp.arange(t.size).reshape(t.shape))) for t in fn(a, x))

    fused = nnx.jit(lambda a, x: a.project_qkv(x, pos))(attn, x)
    for got, want in zip(fused, separate(attn, x)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    g_fused = nnx.grad(lambda a, x: loss(lambda a, x: a.project_qkv(x, pos), a, x), argnums=(0, 1))(attn, x)
    g_sep = nnx.grad(lambda a, x: loss(separate, a, x), argnums=(0, 1))(attn, x)
    for got, want in zip(jax.tree.leaves(g_fused), jax.tree.leaves(g_sep)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_fused_gate_up_matches_swiglu_of_the_separate_projections():
    mlp = MLP(_model_cfg(), dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = _x((2, 16, 64), 2)
    want = mlp.down_proj(jax.nn.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    np.testing.assert_allclose(mlp(x), want, rtol=1e-5, atol=1e-6)


def test_fused_fp8_gemm_uses_the_smallest_scale_and_reports_its_amaxes_to_every_part():
    policy = QuantPolicy(fp8_recipe="delayed")
    parts = [Linear((32,), (n,), in_axes=(None,), out_axes=(None,), std=0.1, quant=policy, rngs=nnx.Rngs(i))
             for i, n in enumerate((48, 16))]
    parts[0].fp8_meta[...] = jnp.array([2.0, 300.0, 1.0])
    parts[1].fp8_meta[...] = jnp.array([2.0, 200.0, 4.0])
    x = _x((8, 32), 3)
    y = jnp.concatenate(fused_linear(x, parts, ((48,), (16,)), axis=0), axis=-1)
    w = jnp.concatenate([p.kernel[...] for p in parts], axis=1)  # [32, 64]
    expected = fp8_matmul(x, w, jnp.array([2.0, 200.0, 1.0]), Fp8Spec("delayed"))
    np.testing.assert_array_equal(y, expected)

    def total(parts):
        return jnp.sum(jnp.concatenate(fused_linear(x, parts, ((48,), (16,)), axis=0), axis=-1))

    grads = nnx.grad(total, argnums=nnx.DiffState(0, Fp8Meta))(parts)
    amaxes = [g.fp8_meta[...] for g in grads]
    np.testing.assert_array_equal(amaxes[0], amaxes[1])
    np.testing.assert_allclose(amaxes[0][:2], [jnp.abs(x).max(), jnp.abs(w).max()], rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_swiglu_pairs_gradient_matches_autodiff_in_fp32(dtype):
    """16-bit pairs take the packed backward (each pair one 32-bit word); fp32 takes autodiff."""
    y = (_x((4, 16, 24, 2), 4) * 2).astype(dtype)
    dh = _x((4, 16, 24), 5).astype(dtype)
    got_y, vjp = jax.vjp(swiglu_pairs, y)
    want_y, want_vjp = jax.vjp(lambda y: jax.nn.silu(y[..., 0]) * y[..., 1], y.astype(jnp.float32))
    tol = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3, jnp.float32: 1e-6}[dtype]
    np.testing.assert_allclose(np.asarray(got_y, np.float32), want_y, rtol=tol, atol=tol)
    got, want = np.asarray(vjp(dh)[0], np.float32), np.asarray(want_vjp(dh.astype(jnp.float32))[0])
    assert got.shape == y.shape
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    assert np.abs(got[..., 0] - want[..., 1]).max() > 10 * tol  # the two halves are told apart
