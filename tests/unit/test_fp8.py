"""Per-tensor FP8 (delayed, tensorwise): quantization against ml_dtypes, the custom_vjp GEMMs against NumPy
oracles and against bf16, the amax "gradients", the amax-history update, and FP8 dots in the lowered step."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mjax.kernels.quant import fp8
from mjax.kernels.quant.fp8 import Fp8Spec, fp8_matmul
from mjax.train import fp8_state


def _inputs(m=64, k=128, n=96, seed=0):
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = (jax.random.normal(kx, (m, k)) * 2).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (k, n)) * 0.05
    g = (jax.random.normal(kg, (m, n)) * 1e-3).astype(jnp.bfloat16)
    return x, w, g


def _np_quant(x, scale, dtype):
    m = float(ml_dtypes.finfo(dtype).max)
    return np.clip(np.asarray(x, np.float32) * np.float32(scale), -m, m).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_quantize_matches_ml_dtypes(dtype):
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 300
    x[:3] = [1e6, -1e6, 0.0]  # saturate, not NaN
    for scale in (1.0, 0.37, 12.0):
        got = np.asarray(fp8.quantize(jnp.asarray(x), scale, dtype))
        np.testing.assert_array_equal(got.astype(np.float32), _np_quant(x, scale, dtype).astype(np.float32))
    assert np.isfinite(np.asarray(fp8.quantize(jnp.asarray(x), 1.0, dtype)).astype(np.float32)).all()


def test_pow2_floor_is_exact_at_the_edges():
    s = np.array([1.0, 448 / 3.5, 2.0, np.nextafter(np.float32(2.0), np.float32(0)), 3e-15, 5e15, 57344 / 1e-6],
                 np.float32)
    np.testing.assert_array_equal(np.asarray(fp8.pow2_floor(jnp.asarray(s))), 2.0 ** np.floor(np.log2(s)))
    # An amax of 1e-37 gives an infinite fp8_max / amax (zeros times it are NaN, the rest saturates); the scale the
    # GEMM uses stays finite, so such a tensor quantizes to what it is, next to nothing.
    tiny = jnp.array([1e-37, -3e-38, 0.0], jnp.float32)
    scale = fp8.pow2_floor(fp8.scale_from_amax(jnp.max(jnp.abs(tiny)), jnp.float8_e4m3fn))
    assert float(scale) == 2.0**63
    q = np.asarray(fp8.quantize(tiny, scale, jnp.float8_e4m3fn), np.float32)
    assert np.isfinite(q).all() and (np.abs(q) < 1).all()


def test_scale_from_amax():
    s = fp8.scale_from_amax(jnp.array([2.0, 0.0, jnp.inf, jnp.nan]), jnp.float8_e4m3fn, margin=1, fallback=7.0)
    np.testing.assert_allclose(np.asarray(s), [448 / 4, 7.0, 7.0, 7.0])


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("recipe,fmt", [("tensorwise", "hybrid"), ("tensorwise", "e4m3"), ("delayed", "hybrid")])
def test_fp8_matmul_against_numpy_oracle(recipe, fmt, impl):
    """Forward, dgrad and wgrad equal the NumPy products of the ml_dtypes-quantized operands, with the FP8 copies
    made by XLA or by the cast-transpose kernel (interpreted)."""
    x, w, g = _inputs()
    spec = Fp8Spec(recipe, fmt, impl=impl, interpret=impl == "pallas")
    fwd_dt, grad_dt = (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2 if fmt == "hybrid" else ml_dtypes.float8_e4m3fn)
    xn, wn, gn = (np.asarray(t, np.float32) for t in (x, w, g))
    ax, aw, ag = (np.abs(t).max() for t in (xn, wn, gn))
    if recipe == "delayed":  # scales from "last step": deliberately off, with the grad scale too small to saturate
        scales = np.array([448 / (ax * 0.5), 448 / (aw * 2), 57344 / (ag * 4)], np.float32)
    else:
        scales = np.array([448 / ax, 448 / aw, float(ml_dtypes.finfo(grad_dt).max) / ag], np.float32)
    meta = jnp.asarray(scales) if recipe == "delayed" else jnp.ones(3)
    scales = 2.0 ** np.floor(np.log2(scales))  # the GEMMs quantize with the scales rounded down to powers of two
    def fwd_bwd(x, w, meta, g):
        y, vjp = jax.vjp(lambda x, w, m: fp8_matmul(x, w, m, spec), x, w, meta)
        return y, *vjp(g)

    y, dx, dw, dmeta = jax.jit(fwd_bwd)(x, w, meta, g)

    xq, wq = (_np_quant(t, s, fwd_dt).astype(np.float32) / s for t, s in ((xn, scales[0]), (wn, scales[1])))
    gq = _np_quant(gn, scales[2], grad_dt).astype(np.float32) / scales[2]
    np.testing.assert_allclose(np.asarray(y, np.float32), xq @ wq, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(dx, np.float32), gq @ wq.T, rtol=2e-2, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), xq.T @ gq, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dmeta), [ax, aw, ag], rtol=1e-6)  # the amax slot, not a gradient
    assert dx.dtype == x.dtype and dw.dtype == w.dtype


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("fmt,tol", [("e4m3", 0.1), ("hybrid", 0.15)])  # e4m3 rounds to 2^-4, e5m2 to 2^-3
def test_fp8_grads_close_to_bf16(fmt, tol):
    x, w, _ = _inputs(128, 256, 128, seed=1)

    def loss(f, x, w):
        return jnp.sum(jnp.sin(f(x, w).astype(jnp.float32)))

    exact = jax.jit(jax.grad(lambda x, w: loss(lambda a, b: a.astype(jnp.float32) @ b, x, w), (0, 1)))(x, w)
    q = jax.jit(jax.grad(lambda x, w: loss(lambda a, b: fp8_matmul(a, b, jnp.ones(3), Fp8Spec("tensorwise", fmt)),
                                           x, w), (0, 1)))(x, w)
    for a, b in zip(q, exact):
        assert _rel(a, b) < tol


def test_fp8_dots_reach_xla():
    """The operands XLA sees are FP8 straight into dot_general (the cuBLASLt-rewritable form), in all 3 GEMMs."""
    x, w, _ = _inputs()
    f = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(fp8_matmul(x, w, jnp.ones(3), Fp8Spec())), (0, 1)))
    hlo = f.lower(x, w).as_text()
    dots = [line for line in hlo.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 3
    assert all("f8E4M3FN" in d for d in dots) and sum("f8E5M2" in d for d in dots) == 2
    # Each product is rescaled by a multiply in its own dtype (which XLA folds into the FP8 GEMM's scale), not
    # converted to f32 first.
    for d in dots:
        name, out_type = re.match(r"\s*(%\w+) = .*-> (tensor<[^>]*>)", d).groups()
        users = [line for line in hlo.splitlines() if re.search(rf"{name}\b", line.split("=", 1)[-1])]
        assert len(users) == 1 and "stablehlo.multiply" in users[0] and users[0].rstrip().endswith(out_type), users


def test_history_update_most_recent_and_max():
    p = type("P", (), dict(fp8_format="hybrid", fp8_margin=0, fp8_recipe="delayed",
                           fp8_amax_compute_algo="most_recent"))
    state = fp8_state.Fp8State.create({"l": jnp.ones((2, 3))}, history_len=3)  # two stacked layers
    for amax in ([4.0, 2.0, 8.0], [8.0, 1.0, 1.0]):
        state, stats = fp8_state.update(state, {"l": jnp.tile(jnp.array(amax), (2, 1))}, p)
    np.testing.assert_allclose(state.amax_history["l"][0], [[8, 1, 1], [4, 2, 8], [0, 0, 0]])
    np.testing.assert_allclose(state.scales["l"][0], [448 / 8, 448, 57344])
    assert int(stats["fp8_overflow"]) == 2  # amax 8 met the scale 448/4 of the last step: saturated, in both layers

    p.fp8_amax_compute_algo, p.fp8_margin = "max", 1
    state2, stats = fp8_state.update(state, {"l": jnp.array([[0.5, jnp.nan, 0.0]] * 2)}, p)
    np.testing.assert_allclose(state2.amax_history["l"][1, 0], [0.5, 0.0, 0.0])  # a NaN amax is recorded as 0
    np.testing.assert_allclose(state2.scales["l"][1], [448 / 8 / 2, 448 / 2 / 2, 57344 / 8 / 2])
    assert int(stats["fp8_nonfinite_amax"]) == 2


def test_overflow_counts_the_scale_the_gemm_used():
    """Scale 448/4 quantizes with 64: amax 5 fits (320 <= 448) though 5 x 112 would not; amax 8 saturates (512)."""
    scales = {"l": jnp.array([448 / 4, 448 / 4, 57344.0])}
    stats = fp8_state.statistics(scales, {"l": jnp.array([5.0, 8.0, 0.5])}, jnp.array([448.0, 448.0, 57344.0]), True)
    assert int(stats["fp8_overflow"]) == 1


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_kept_fp8_operands_give_the_same_values_and_gradients(recipe):
    """Remat keeping fp8_cast hands the backward the forward's own FP8 operands: same loss and gradients as no
    remat (FP8-typed residuals once came back as NaN; they travel as bytes)."""
    x = jax.random.normal(jax.random.key(0), (64, 32), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (32, 16), jnp.float32)
    meta = jnp.array([448 / 4, 448 / 4, 57344 / 4], jnp.float32)
    f = lambda x, w, m: jnp.sum(fp8_matmul(x, w, m, Fp8Spec(recipe=recipe)).astype(jnp.float32) ** 2)  # noqa: E731
    ref = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(x, w, meta)
    kept = jax.jit(jax.value_and_grad(
        jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names("fp8_cast")), argnums=(0, 1, 2)))(
        x, w, meta)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(kept)):
        assert np.all(np.isfinite(np.asarray(b, np.float32)))
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_amax_read_as_words_is_the_same_value(dtype):
    """amax(words=True) compares the magnitudes' bits as integers: the same as max |x|, including subnormals,
    the largest finite value, inf and NaN."""
    x = jax.random.normal(jax.random.key(0), (64, 128), jnp.float32) * jnp.logspace(-6, 4, 128)
    x = x.astype(dtype)
    tiny = jnp.finfo(dtype).smallest_subnormal
    # all three reductions of a tensor in one program (op by op, each of their ops compiled on its own)
    three = jax.jit(lambda t: (fp8.amax(t, words=True), fp8.amax(t), jnp.max(jnp.abs(t.astype(jnp.float32)))))
    for t in (x, -jnp.abs(x), jnp.full((4, 8), tiny, dtype), x.at[5, 7].set(-jnp.finfo(dtype).max),
              x.at[1, 2].set(-jnp.inf), jnp.zeros((2, 6), dtype)):
        words, plain, want = three(t)
        assert words == plain == want
    assert jnp.isnan(three(x.at[3, 3].set(jnp.nan))[0])
    odd = x[:, :5]  # an odd last dim has no words: the plain reduction
    words, _, want = three(odd)
    assert words == want
    assert "uint32" in str(jax.make_jaxpr(lambda t: fp8.amax(t, words=True))(x))


def test_swiglu_gradient_amax_reads_the_words_its_backward_wrote(monkeypatch):
    """Tensorwise FP8: the gate/up GEMM's output gradient (written by swiglu_pairs' backward as 32-bit words) has
    its amax reduced over those words, and only it; the gradients equal those of the plain reduction."""
    from flax import nnx  # noqa: PLC0415

    from mjax.config import load_config  # noqa: PLC0415
    from mjax.kernels.quant import QuantPolicy  # noqa: PLC0415
    from mjax.model.mlp import MLP  # noqa: PLC0415

    cfg = load_config("tiny").replace(model=dict(hidden_size=64, ffn_hidden_size=128)).model
    mlp = MLP(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, quant=QuantPolicy(fp8_recipe="tensorwise"),
              rngs=nnx.Rngs(0))
    graph, params = nnx.split(mlp)
    x = jax.random.normal(jax.random.key(1), (2, 16, 64), jnp.bfloat16)
    grads = jax.grad(lambda p, x: jnp.sum(nnx.merge(graph, p)(x).astype(jnp.float32) ** 2), argnums=(0, 1))
    assert len(re.findall(r"u32\[\] = reduce_max", str(jax.make_jaxpr(grads)(params, x)))) == 1
    got = jax.jit(grads)(params, x)
    plain = fp8.amax
    monkeypatch.setattr(fp8, "amax", lambda t, words=False: plain(t))
    patched = jax.jit(lambda p, x: grads(p, x))  # a new function: traced afresh, with the plain reduction
    assert "u32[] = reduce_max" not in str(jax.make_jaxpr(patched)(params, x))
    want = patched(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
