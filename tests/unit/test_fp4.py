"""FP4 emulation (NVFP4, MXFP4): quantize-dequantize against a NumPy/ml_dtypes oracle, the fused Pallas kernel
(interpreted) against the reference, the round trip surviving XLA (HLO), the Hadamard transform, and gradients."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mjax.kernels.quant import fp4
from mjax.kernels.quant.fp4_pallas import fake_quant_pallas, round_e2m1


def _np_fake_quant(x, recipe):
    """NumPy oracle with ml_dtypes casts, written from the NVFP4 / OCP MX definitions."""
    b = fp4.BLOCKS[recipe]
    xb = x.astype(np.float32).reshape(x.shape[0], -1, b)
    amax = np.abs(xb).max(-1, keepdims=True)
    if recipe == "nvfp4":
        g = np.float32(np.abs(x).max() / (6 * 448))
        s = np.clip(amax / g / np.float32(6), 0, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * g
    else:
        s = 2.0 ** np.ceil(np.log2(np.maximum(amax / np.float32(6), 2.0**-126)))  # power of two, rounded up
        s = s.astype(np.float32)
    q = np.clip(xb / np.where(s > 0, s, 1), -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return (q * s).reshape(x.shape)


# Compiled as one program each: op by op, every one of their few hundred ops compiles on its own.
_reference = jax.jit(fp4.fake_quant_reference, static_argnums=(1,), static_argnames=("stochastic",))


@functools.partial(jax.jit, static_argnums=3)
def _forward_and_gradients(x, w, g, spec):
    y, vjp = jax.vjp(lambda x, w: fp4.fp4_matmul(x, w, spec), x, w)
    return y, *vjp(g)


def _data(shape=(32, 256), seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * np.exp(rng.standard_normal((shape[0], 1)) * 2)
    x[0, :32] = 0.0  # all-zero blocks
    x[1, 5] = 1e3  # an outlier dominating the tensor scale
    return x


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_reference_matches_numpy(recipe):
    x = _data()
    got = np.asarray(_reference(jnp.asarray(x), recipe))
    np.testing.assert_allclose(got, _np_fake_quant(x, recipe), rtol=1e-6, atol=1e-30)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    if recipe == "mxfp4":  # every value is a grid point times its block's power-of-two scale
        s = 2.0 ** np.ceil(np.log2(np.maximum(np.abs(x.reshape(32, -1, 32)).max(-1) / 6, 2.0**-126)))
        codes = np.abs(got.reshape(32, -1, 32)) / s[..., None]
        assert np.isin(codes, grid).all()


def test_e2m1_rounding_matches_ml_dtypes_cast():
    v = np.linspace(-6, 6, 24001).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(round_e2m1(jnp.asarray(v))),
                                  v.astype(ml_dtypes.float4_e2m1fn).astype(np.float32))


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_pallas_fused_kernel_matches_reference(recipe):
    x = jnp.asarray(_data((48, 160), seed=1))  # 48 x 160 / block: blocks not a multiple of the kernel's rows
    ref = _reference(x, recipe)
    got = fake_quant_pallas(x, recipe=recipe, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6, atol=1e-30)


def test_round_trip_is_not_folded_away():
    """On GPU XLA folds f32 -> e2m1 -> f32 into a no-op unless an optimization barrier holds it (docs/fp8.md; the CPU
    pipeline does not fold, so here we check that the barrier and the casts reach the compiled HLO, and
    benchmarks/bench_fp8.py shows the fold on the GPU)."""
    x = jnp.asarray(_data())
    kept = jax.jit(lambda x: fp4.fake_quant_reference(x, "nvfp4")).lower(x).compile().as_text()
    assert "f4e2m1fn" in kept and "optimization_barrier" in kept
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: fp4.fake_quant_reference(x, "mxfp4"))(x)),
                                  _np_fake_quant(np.asarray(x), "mxfp4"))  # the compiled values are quantized


def test_hadamard_is_orthogonal_and_cancels_in_wgrad():
    h = fp4.hadamard_matrix()
    np.testing.assert_allclose(h @ h.T, np.eye(16), atol=1e-6)
    rng = np.random.default_rng(3)
    x, g = rng.standard_normal((64, 24)).astype(np.float32), rng.standard_normal((64, 8)).astype(np.float32)
    hx, hg = fp4.hadamard_rows(jnp.asarray(x)), fp4.hadamard_rows(jnp.asarray(g))
    np.testing.assert_allclose(np.asarray(hx).T @ np.asarray(hg), x.T @ g, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("recipe,hadamard,impl", [("nvfp4", False, "xla"), ("mxfp4", True, "pallas")])
def test_fp4_matmul_grads_close_to_exact(recipe, hadamard, impl):
    kx, kw = jax.random.split(jax.random.key(4))
    x = jax.random.normal(kx, (100, 96)).astype(jnp.bfloat16)  # 100 tokens: padded for 16/32 blocks and the RHT
    w = jax.random.normal(kw, (96, 64)) * 0.05
    spec = fp4.Fp4Spec(recipe, hadamard, impl=impl, interpret=True)

    def loss(f, x, w):
        return jnp.sum(jnp.sin(3 * f(x, w).astype(jnp.float32)))

    exact = jax.jit(jax.grad(lambda x, w: loss(lambda a, b: a.astype(jnp.float32) @ b, x, w), (0, 1)))(x, w)
    got = jax.jit(jax.grad(lambda x, w: loss(lambda a, b: fp4.fp4_matmul(a, b, spec), x, w), (0, 1)))(x, w)
    for a, b in zip(got, exact):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 0.35  # e2m1 keeps ~1 mantissa bit
    assert got[1].dtype == w.dtype and got[0].dtype == x.dtype


@pytest.mark.parametrize("recipe,hadamard,impl", [("mxfp4", False, "xla"), ("nvfp4", False, "xla"),
                                                  ("nvfp4", True, "pallas"), ("mxfp4", True, "pallas")])
def test_fp4_matmul_gemms_are_products_of_separately_quantized_operands(recipe, hadamard, impl):
    """Forward (x and w along K), dgrad (g and w along N) and wgrad (x and g along M, after the random Hadamard
    transform of 16-row groups when asked) against NumPy products of the oracle's quantized operands."""
    rng = np.random.default_rng(5)  # rows of different magnitude; no outlier, whose bf16 rounding would dominate
    x = jnp.asarray(rng.standard_normal((32, 64)) * np.exp(rng.standard_normal((32, 1))), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 32)) * 0.1, jnp.float32)
    g = jnp.asarray(rng.standard_normal((32, 32)) * np.exp(rng.standard_normal((32, 1))), jnp.bfloat16)
    spec = fp4.Fp4Spec(recipe, hadamard, impl=impl, interpret=True)
    y, dx, dw = _forward_and_gradients(x, w, g, spec)

    def q(a, axis):  # the oracle, blocks along `axis`
        a = np.asarray(a, np.float32)
        return (_np_fake_quant(a, recipe) if axis == 1 else _np_fake_quant(a.T, recipe).T).astype(np.float64)

    xn, gn = np.asarray(x, np.float32), np.asarray(g, np.float32)
    wn = np.asarray(w.astype(jnp.bfloat16), np.float32)
    xt, gt = xn, gn
    if hadamard:  # an independent block-diagonal form of the transform
        big = np.kron(np.eye(xn.shape[0] // 16), fp4.hadamard_matrix())
        xt = np.asarray(jnp.asarray(big @ xn, jnp.bfloat16), np.float32)  # the transform returns x's dtype
        gt = np.asarray(jnp.asarray(big @ gn, jnp.bfloat16), np.float32)
    for name, got, want in (("y", y, q(xn, 1) @ q(wn, 0)), ("dx", dx, q(gn, 1) @ q(wn, 1).T),
                            ("dw", dw, q(xt, 0).T @ q(gt, 0))):
        # Normwise: within 0.5% here; skipping a quantization or quantizing along the wrong axis is off by 12-22%.
        got = np.asarray(got, np.float64)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2, name


# ---------------------------------------------------------------- stochastic rounding (--fp4_stochastic_rounding)

def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased():
    """Over u on a fine grid of [0, 1): every result is one of v's two e2m1 neighbours, the mean is v (to the
    grid's resolution), and grid values stay put."""
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    v = jnp.asarray([0.1, 0.3, 0.75, 1.2, 1.9, 2.5, 2.25, 3.9, 4.5, 5.99, -2.75, -0.2, *grid, *-grid[1:]],
                    jnp.float32)
    u = (jnp.arange(4096, dtype=jnp.float32) + 0.5) / 4096
    r = np.asarray(jax.jit(jax.vmap(lambda u: fp4.round_e2m1_stochastic(v, u)))(u))  # [U, V]
    vn = np.asarray(v)
    lo = np.array([grid[grid <= abs(a)].max() for a in vn]) * np.sign(vn)
    hi = np.array([grid[grid >= abs(a)].min() for a in vn]) * np.sign(vn)
    assert np.all((r == lo) | (r == hi))
    np.testing.assert_allclose(r.mean(0), vn, atol=1e-3)
    on_grid = np.isin(np.abs(vn), grid)
    assert np.all(r[:, on_grid] == vn[on_grid])


def test_stochastic_fake_quant_removes_the_rounding_bias():
    """MXFP4 blocks of 32 whose amax 6 makes the scale 1: the other elements at 2.5 round to 2 (ties to even) with
    round-to-nearest, always; stochastically half go to 3, so their mean stays 2.5. At 2.25 a quarter go up."""
    for value, up in ((2.5, 0.5), (2.25, 0.25)):
        x = np.full((256, 128), value, np.float32)
        x[:, ::32] = 6.0
        x = jnp.asarray(x, jnp.bfloat16)
        nearest = np.asarray(_reference(x, "mxfp4"), np.float32)
        sr = np.asarray(_reference(x, "mxfp4", stochastic=True), np.float32)
        rest = np.ones(x.shape, bool)
        rest[:, ::32] = False
        assert np.all(nearest[rest] == 2.0) and np.all(sr[~rest] == 6.0)
        assert set(np.unique(sr[rest])) == {2.0, 3.0}
        assert abs(np.mean(sr[rest] == 3.0) - up) < 0.02  # 31,744 draws: sd 0.003


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_stochastic_pallas_kernel_matches_reference_bitwise(recipe):
    x = jnp.asarray(_data((48, 256), seed=7), jnp.bfloat16)  # 48 rows: the kernel pads to whole programs
    want = np.asarray(_reference(x, recipe, stochastic=True), np.float32)
    got = np.asarray(fake_quant_pallas(x, recipe=recipe, interpret=True, stochastic=True), np.float32)
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(want, np.asarray(_reference(x, recipe), np.float32))


def test_stochastic_rounding_touches_only_the_output_gradient():
    """The forward is unchanged; dx and dw move (their g copies round differently) and stay as close to the exact
    gradients as round-to-nearest's."""
    kx, kw, kg = jax.random.split(jax.random.key(8), 3)
    x = jax.random.normal(kx, (128, 96)).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (96, 64)) * 0.05
    g = jax.random.normal(kg, (128, 64)).astype(jnp.bfloat16)
    out = {}
    for sr in (False, True):
        spec = fp4.Fp4Spec("nvfp4", stochastic=sr, impl="xla")
        out[sr] = tuple(np.asarray(t, np.float32) for t in _forward_and_gradients(x, w, g, spec))
    np.testing.assert_array_equal(out[True][0], out[False][0])
    exact = (np.asarray(g, np.float32) @ np.asarray(w, np.float32).T,
             np.asarray(x, np.float32).T @ np.asarray(g, np.float32))
    for i, want in zip((1, 2), exact):
        assert not np.array_equal(out[True][i], out[False][i])
        err = {sr: np.linalg.norm(out[sr][i] - want) / np.linalg.norm(want) for sr in (False, True)}
        assert err[True] < 1.5 * err[False] < 0.5, err
