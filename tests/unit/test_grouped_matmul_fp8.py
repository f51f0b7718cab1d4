"""Per-tensor FP8 grouped matmul (mjax/kernels/grouped_matmul/fp8.py): y, dx, dw and the observed amaxes of the Pallas
kernels (interpreted) and of the dequantize + ragged_dot reference against a NumPy float64 oracle of the same
quantization (ml_dtypes casts), with ragged and empty groups and NaN padding rows, both recipes and formats; jax.vmap
over dispatch groups (one scale for all of them); remat keeping fp8_cast; the Triton lowering of every FP8 kernel
for an H200; the dispatch and its capability table."""

import functools

import jax
import jax.experimental.pallas.fuser  # noqa: F401 (see below)
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mjax.kernels.quant.fp8 import Fp8Spec
from mjax.kernels.grouped_matmul import (GroupedMatmulUnsupported, KernelTile, Tiling, choose_impl,
                                         fp8_grouped_matmul, resolve_tiling, why_unsupported)
from mjax.kernels.grouped_matmul.fp8 import GroupedFp8Plan, grouped_fp8
from tests.helpers.gpu_lowering import assert_grouped_fwd_bwd_lowers
from tests.unit.test_grouped_matmul import _tolerance

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
# The import above registers a jit-cache config option; imported lazily by the first interpreted pallas_call, it
# changed every cache key once and recompiled every program compiled before it.

# 16-row blocks (groups straddle and share them), 32 deep: forward 2 depth steps over K, dgrad 3 over N; wgrad walks
# 32-row chunks from unaligned group starts, and M = 60 ends inside a chunk.
TINY = Tiling.uniform(KernelTile(16, 32, 32))
K, M = 64, 60
NS = (96, 64)  # two weights reading one x (the MoE gate and up projections)
CASES = {
    "ragged": [0, 3, 2, 4, 0, 25, 13, 1, 0],  # empty groups first, inside and last; 12 padding rows
    "one_group": [0, 0, 0, 0, M, 0, 0, 0, 0],
    "all_padding": [0] * 9,
    "whole_blocks": [16, 0, 32, 0, 0, 0, 0, 0, 0],
}
RECIPES = [("tensorwise", "hybrid"), ("tensorwise", "e4m3"), ("delayed", "hybrid")]
E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


# ---- the NumPy oracle ----

def np_pow2_floor(s):
    return 2.0 ** np.floor(np.log2(np.asarray(s, np.float64)))


def np_scale(amax, dtype):  # fp8_max / amax, 1 for an amax of zero; rounded down to a power of two
    fmax = float(ml_dtypes.finfo(dtype).max)
    return np_pow2_floor(np.where(amax > 0, fmax / np.where(amax > 0, amax, 1.0), 1.0))


def np_dequant(v, scale, dtype):
    """saturate(v * scale) cast to `dtype` (in float32, as the code casts), back to float64 values."""
    fmax = float(ml_dtypes.finfo(dtype).max)
    q = np.clip(np.asarray(v, np.float32) * np.asarray(scale, np.float32), -fmax, fmax).astype(dtype)
    return q.astype(np.float64) / np.asarray(scale, np.float64)


def oracle(items, ws, metas, recipe, fmt):
    """items: [(x [M, K], group sizes [G], dys: one [M, N_i] per weight)], one per dispatch group, sharing ws and
    metas. Returns per item {y: [..], dx}, dw per weight (summed over items), observed [G, 3] per weight, and the
    same products of absolute values (the scale of each result's rounding error)."""
    grad_dtype = E5M2 if fmt == "hybrid" else E4M3
    groups = len(ws[0])
    real = [(np.asarray(x, np.float32)[:sum(s)], s, [np.asarray(d, np.float32)[:sum(s)] for d in dys])
            for x, s, dys in items]
    ax = max((np.abs(x).max() for x, _, _ in real if x.size), default=0.0)
    sx = np_pow2_floor(min(m[:, 0].min() for m in metas)) if recipe == "delayed" else np_scale(ax, E4M3)
    outs = [dict(y=[], dx=np.zeros((len(x_full), K)), dx_abs=np.zeros((len(x_full), K)), y_abs=[])
            for x_full, _, _ in items]
    dws, dw_abs, observed = [], [], []
    for i, (w, meta) in enumerate(zip(ws, metas)):
        w = np.asarray(w, np.float32)
        aw = np.abs(w).max(axis=(1, 2))
        sw = np_pow2_floor(meta[:, 1]) if recipe == "delayed" else np_scale(aw, E4M3)
        wd = np.stack([np_dequant(w[g], sw[g], E4M3) for g in range(groups)])
        ag = max((np.abs(d[i]).max() for _, _, d in real if d[i].size), default=0.0)
        sg = np_pow2_floor(meta[:, 2].min()) if recipe == "delayed" else np_scale(ag, grad_dtype)
        dw, dwa = np.zeros(w.shape), np.zeros(w.shape)
        for (x, sizes, dys), out in zip(real, outs):
            xd, gd = np_dequant(x, sx, E4M3), np_dequant(dys[i], sg, grad_dtype)
            y, ya = np.zeros((out["dx"].shape[0], w.shape[2])), np.zeros((out["dx"].shape[0], w.shape[2]))
            start = 0
            for g, size in enumerate(sizes):
                r = slice(start, start + size)
                for f, (yy, dx, dww) in ((lambda a: a, (y, out["dx"], dw)), (np.abs, (ya, out["dx_abs"], dwa))):
                    yy[r] = f(xd[r]) @ f(wd[g])
                    dx[r] += f(gd[r]) @ f(wd[g]).T
                    dww[g] += f(xd[r]).T @ f(gd[r])
                start += size
            out["y"].append(y)
            out["y_abs"].append(ya)
        dws.append(dw)
        dw_abs.append(dwa)
        observed.append(np.stack([np.full(groups, ax), aw, np.full(groups, ag)], axis=-1))
    return outs, dws, dw_abs, observed


# ---- inputs and the code under test ----

def make_inputs(sizes, dtype=jnp.float32, seed=0, batch=None):
    """x, ws, dys with NaN in the padding rows of x and dy (which must reach nothing); w scaled per expert, so that
    the per-expert weight scales differ."""
    lead = () if batch is None else (batch,)
    total = np.asarray(sizes).sum(-1)[..., None, None]  # [..., 1, 1]
    pad = np.arange(M)[:, None] >= total  # [..., M, 1]
    return _random_inputs(seed, pad, dtype=jnp.dtype(dtype), lead=lead, groups=np.shape(sizes)[-1])


@functools.partial(jax.jit, static_argnames=("dtype", "lead", "groups"))  # one program, not ~20 ops apiece
def _random_inputs(seed, pad, *, dtype, lead, groups):
    keys = jax.random.split(jax.random.key(seed), 2 + 2 * len(NS))
    x = jnp.where(pad, jnp.nan, 2 * jax.random.normal(keys[0], (*lead, M, K))).astype(dtype)
    spread = jnp.logspace(-2, 1, groups)[:, None, None]  # expert g's weights ~ 10^(-2 + 3 g / (G - 1))
    ws = tuple(jax.random.normal(keys[1 + i], (groups, K, n)) * spread for i, n in enumerate(NS))
    dys = tuple(jnp.where(pad, jnp.nan, 1e-3 * jax.random.normal(keys[1 + len(NS) + i], (*lead, M, n))).astype(dtype)
                for i, n in enumerate(NS))
    return x, ws, dys


def delayed_metas(x, ws, dys, sizes):
    """Scales "from earlier steps": deliberately off (x saturates; w and grad scales too small), per expert for w,
    with the two metas' x scales different (the GEMM takes the smaller) and one expert's x entry smaller still."""
    total = sum(sizes)
    ax = float(np.nanmax(np.abs(np.asarray(x, np.float32)[:total]))) if total else 1.0
    metas = []
    for i, (w, dy) in enumerate(zip(ws, dys)):
        aw = np.abs(np.asarray(w)).max(axis=(1, 2))
        ag = float(np.nanmax(np.abs(np.asarray(dy, np.float32)[:total]))) if total else 1.0
        meta = np.stack([np.full(len(aw), 448 / (ax * (0.5 + 0.25 * i))), 448 / (aw * 2),
                         np.full(len(aw), 57344 / (ag * 4))], -1).astype(np.float32)
        meta[3, 0] *= 0.7
        metas.append(meta)
    return tuple(metas)


@functools.partial(jax.jit, static_argnames=("impl", "recipe", "fmt"))
def run(impl, recipe, fmt, x, ws, group_sizes, metas, dys):
    spec = Fp8Spec(recipe, fmt)
    tiling = TINY if impl == "pallas" else None
    f = lambda x, ws, metas: fp8_grouped_matmul(x, ws, group_sizes, metas, spec, impl=impl, tiling=tiling)  # noqa: E731
    ys, vjp = jax.vjp(f, x, ws, metas)
    dx, dws, observed = vjp(dys)
    return ys, dx, dws, observed


def check(got, want, scale, depth, dtype, name, extra=0.0):
    """|got - want| within the float32 accumulation and output rounding bound of test_grouped_matmul (plus `extra`
    relative to `scale`): the quantized operands are the oracle's exactly, so nothing else may differ."""
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, name
    excess = np.abs(got - want) - _tolerance(scale, depth, dtype) - extra * scale
    assert np.all(excess <= 0), f"{name}: exceeds the tolerance by up to {np.nanmax(excess)} (NaN anywhere: " \
                                f"{np.isnan(got).any()})"


def check_against_oracle(result, items, ws, metas, recipe, fmt, dtype):
    """result: (ys, dx, dws, observed) per item (a list) except dws and observed (shared)."""
    outs, dws, dw_abs, observed = oracle(items, ws, metas, recipe, fmt)
    (ys_items, dx_items, got_dws, got_observed) = result
    for (x, sizes, _), out, ys, dx in zip(items, outs, ys_items, dx_items):
        total = sum(sizes)
        for i, y in enumerate(ys):
            assert y.dtype == dtype
            check(y, out["y"][i], out["y_abs"][i], K, dtype, f"y[{i}]")
            assert np.all(np.asarray(y)[total:] == 0)
        # dx sums the weights' parts, each rounded to dtype: one more rounding, of the sum.
        check(dx, out["dx"], out["dx_abs"], max(NS), dtype, "dx", extra=2.0 ** -jnp.finfo(dtype).nmant)
        assert dx.dtype == dtype and np.all(np.asarray(dx)[total:] == 0)
    depth = max(max(s) for _, s, _ in items) * len(items)
    for i, (dw, want, scale) in enumerate(zip(got_dws, dws, dw_abs)):
        assert dw.dtype == jnp.float32
        check(dw, want, scale, depth, jnp.float32, f"dw[{i}]")
        empty = np.all([np.asarray(s) == 0 for _, s, _ in items], axis=0)
        assert np.all(np.asarray(dw)[empty] == 0)
    for got, want in zip(got_observed, observed):  # the amax slot: max |.| over the real rows, exactly
        np.testing.assert_array_equal(np.asarray(got), want.astype(np.float32))


def metas_for(recipe, x, ws, dys, sizes):
    if recipe == "delayed":
        return delayed_metas(x, ws, dys, sizes)
    return tuple(jnp.ones((len(sizes), 3), jnp.float32) for _ in ws)  # tensorwise reads no scale from meta


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("recipe,fmt", RECIPES)
@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_float32_matches_the_numpy_oracle(impl, recipe, fmt, case):
    sizes = CASES[case]
    x, ws, dys = make_inputs(sizes)
    metas = metas_for(recipe, x, ws, dys, sizes)
    ys, dx, dws, observed = run(impl, recipe, fmt, x, ws, jnp.asarray(sizes, jnp.int32), metas, dys)
    check_against_oracle(([ys], [dx], dws, observed), [(x, sizes, dys)], ws, [np.asarray(m) for m in metas], recipe,
                         fmt, jnp.float32)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_bfloat16_matches_the_numpy_oracle(impl):
    sizes = CASES["ragged"]
    x, ws, dys = make_inputs(sizes, jnp.bfloat16, seed=1)
    metas = metas_for("tensorwise", x, ws, dys, sizes)
    ys, dx, dws, observed = run(impl, "tensorwise", "hybrid", x, ws, jnp.asarray(sizes, jnp.int32), metas, dys)
    check_against_oracle(([ys], [dx], dws, observed), [(x, sizes, dys)], ws, [np.asarray(m) for m in metas],
                         "tensorwise", "hybrid", jnp.bfloat16)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_vmap_over_dispatch_groups_shares_one_scale_and_one_amax(impl):
    """x [B, M, K] with other group sizes per item (as MoE's dispatch groups), w and meta shared: each tensor is
    quantized with the scale of its amax over every item's real rows, meta observes that max (not a sum over the
    items) and dw sums the items."""
    sizes = [[5, 0, 20, 3, 0, 0, 0, 0, 0], [0, 0, 0, 28, 0, 0, 1, 0, 0], [10, 10, 0, 0, 0, 7, 0, 0, 30]]
    x, ws, dys = make_inputs(sizes, seed=3, batch=len(sizes))
    x = x.at[1].multiply(3.0)  # the amax of x lives in item 1, that of dy[0] in item 2
    dys = (dys[0].at[2].multiply(5.0), dys[1])
    metas = metas_for("tensorwise", x, ws, dys, sizes[0])
    spec = Fp8Spec("tensorwise", "hybrid")
    tiling = TINY if impl == "pallas" else None

    def loss(x, ws, metas, gs, dys):
        ys = jax.vmap(lambda x, gs: fp8_grouped_matmul(x, ws, gs, metas, spec, impl=impl, tiling=tiling))(x, gs)
        return sum(jnp.vdot(y, d) for y, d in zip(ys, dys)), ys

    gs = jnp.asarray(sizes, jnp.int32)
    dys0 = tuple(jnp.where(jnp.isnan(d), 0, d) for d in dys)  # the loss's cotangents; padding rows unused
    grads, ys = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(x, ws, metas, gs, dys0)
    dx, dws, observed = grads
    items = [(x[b], sizes[b], tuple(d[b] for d in dys)) for b in range(len(sizes))]
    check_against_oracle(([tuple(y[b] for y in ys) for b in range(len(sizes))], list(dx), dws, observed), items, ws,
                         [np.asarray(m) for m in metas], "tensorwise", "hybrid", jnp.float32)


def _fp8_cast_count(jaxpr) -> int:
    """Conversions to an FP8 dtype in a jaxpr and its sub-jaxprs: one per quantized tensor."""
    from jax.extend import core as jcore  # noqa: PLC0415

    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "convert_element_type" and jnp.dtype(eqn.params["new_dtype"]).itemsize == 1
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                if isinstance(sub, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                    n += _fp8_cast_count(getattr(sub, "jaxpr", sub))
    return n


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_remat_keeping_fp8_cast_skips_the_recomputed_casts_and_gives_the_same_results(recipe):
    """Under jax.checkpoint, a policy keeping fp8_cast hands the backward the forward's FP8 operands, scales and
    amaxes: x and both weights are not quantized again, and loss and gradients equal those without
    remat (a linear loss, so the gradients' quantization does not depend on the products' last bits; the
    products themselves may sum in another order in another program: float32 noise)."""
    sizes = CASES["ragged"]
    x, ws, dys = make_inputs(sizes, seed=4)
    x = jnp.where(jnp.isnan(x), 0, x)
    cotangents = tuple(jnp.where(jnp.isnan(d), 0, d) for d in dys)
    metas = delayed_metas(x, ws, dys, sizes)
    gs = jnp.asarray(sizes, jnp.int32)
    spec = Fp8Spec(recipe, "hybrid")

    def f(x, ws, metas):
        ys = fp8_grouped_matmul(x, ws, gs, metas, spec, impl="xla")
        return sum(jnp.vdot(y, c) for y, c in zip(ys, cotangents))

    grad = lambda f: jax.value_and_grad(f, argnums=(0, 1, 2))  # noqa: E731
    kept = jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names("fp8_cast"))
    nothing = jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)
    counts = {name: _fp8_cast_count(jax.make_jaxpr(grad(g))(x, ws, metas).jaxpr)
              for name, g in (("plain", f), ("kept", kept), ("nothing", nothing))}
    assert counts["kept"] == counts["plain"] == 5 and counts["nothing"] == 8, counts  # x, w, w again
    want = jax.jit(grad(f))(x, ws, metas)
    got = jax.jit(grad(kept))(x, ws, metas)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6 * np.abs(np.asarray(a)).max())


# ---- the Triton lowering for an H200 ----

@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])  # hybrid's backward converts its tiles; e4m3's does not
@pytest.mark.parametrize("rows", [1024, 1000])  # whole 128-row blocks, and a last block past the array (masked)
def test_every_fp8_kernel_lowers_through_triton_for_an_h200(fmt, rows):
    """The FP8 copies by the cast-transpose kernel (--quant_impl=pallas), the forward, dgrad and wgrad kernels of two
    weights that share x: 1 + 2 x (1 + 1) forward modules, 2 x 3 backward ones."""
    k, ns, groups = 256, (384, 512), 5
    spec = Fp8Spec("tensorwise", fmt, impl="pallas")
    tilings = tuple(resolve_tiling(None, jnp.bfloat16, k, n, spec.dtypes[1]) for n in ns)
    plan = GroupedFp8Plan(spec, "pallas", tilings, interpret=False)

    def fwd_bwd(x, ws, gs, metas, dys):
        ys, vjp = jax.vjp(lambda x, ws, metas: grouped_fp8(x, ws, gs, metas, plan), x, ws, metas)
        return ys, vjp(dys)

    assert_grouped_fwd_bwd_lowers(fwd_bwd, rows, k, ns, groups, modules=11)


# ---- dispatch and capability table ----

FACTS = dict(dtype=jnp.bfloat16, k=2048, n=768, fp8_grad=jnp.float8_e5m2)


def test_auto_is_the_reference_off_gpu_and_the_kernels_on_gpu():
    assert choose_impl("auto", backend="cpu", **FACTS) == "xla"
    for grad in (jnp.float8_e5m2, jnp.float8_e4m3fn):
        assert choose_impl("auto", backend="gpu", **{**FACTS, "fp8_grad": grad}) == "pallas"
    sizes = CASES["ragged"]
    x, ws, _ = make_inputs(sizes)
    metas = tuple(jnp.ones((9, 3)) for _ in ws)
    jaxpr = str(jax.make_jaxpr(lambda x: fp8_grouped_matmul(x, ws, jnp.asarray(sizes), metas, Fp8Spec()))(x))
    assert "ragged_dot" in jaxpr and "pallas_call" not in jaxpr and "f8_e4m3fn" in jaxpr


def test_default_fp8_tiles_step_128_deep_and_64_where_hybrid_converts_tiles():
    hybrid = resolve_tiling(None, jnp.bfloat16, 2048, 768, jnp.float8_e5m2)
    e4m3 = resolve_tiling(None, jnp.bfloat16, 2048, 768, jnp.float8_e4m3fn)
    assert (hybrid.forward.block_k, hybrid.dgrad.block_k, hybrid.wgrad.block_k) == (128, 64, 64)
    assert (e4m3.forward.block_k, e4m3.dgrad.block_k, e4m3.wgrad.block_k) == (128, 128, 128)
    assert (hybrid.forward.block_n, hybrid.dgrad.block_n, hybrid.wgrad.block_n) == (256, 256, 256)


@pytest.mark.parametrize("facts,reason", [
    (dict(k=2040), "not multiples of 32"),
    (dict(n=784), "not multiples of 32"),  # a multiple of 16 only
    (dict(dtype=jnp.float8_e4m3fn), "bfloat16, float16 or float32"),  # x is the compute-dtype input
    (dict(tiling=Tiling.uniform(KernelTile(128, 128, 16))), "block_k >= 32"),
    (dict(tiling=Tiling(wgrad=KernelTile(128, 512, 64))), "N=768 to be a multiple of block_n=512"),
])
def test_auto_on_gpu_raises_naming_the_flag(facts, reason):
    facts = {**FACTS, **facts}
    assert reason in why_unsupported("pallas", backend="gpu", **facts)
    with pytest.raises(GroupedMatmulUnsupported, match="--moe_grouped_gemm_impl=auto") as err:
        choose_impl("auto", backend="gpu", **facts)
    assert reason in str(err.value)


def test_bad_arguments_raise():
    sizes = CASES["ragged"]
    x, ws, _ = make_inputs(sizes)
    gs = jnp.asarray(sizes)
    ones = jnp.ones((9, 3))
    with pytest.raises(ValueError, match="delayed|tensorwise"):
        fp8_grouped_matmul(x, ws[0], gs, ones, Fp8Spec(recipe="blockwise"))
    with pytest.raises(ValueError, match=r"meta must be \[G, 3\]"):
        fp8_grouped_matmul(x, ws[0], gs, jnp.ones((3,)), Fp8Spec())
    with pytest.raises(ValueError, match="one meta per weight"):
        fp8_grouped_matmul(x, ws, gs, (ones,), Fp8Spec())
    with pytest.raises(GroupedMatmulUnsupported, match="--moe_grouped_gemm_impl"):
        fp8_grouped_matmul(x, ws[0], gs, ones, Fp8Spec(), impl="triton")


# ---- the benchmark (benchmarks/bench_grouped_matmul.py --fp8) ----


@pytest.mark.slow
def test_benchmark_fp8_smoke_run_tables_sweeps_and_checks(tmp_path):
    """The script's FP8 cases end to end off GPU (one tiny shape, kernels interpreted; a subprocess, as its absl
    flags are global): the FP8 rows beside the 16-bit ones, the sweep of the FP8 kernels and --check against the
    reference of the same quantization."""
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    out = tmp_path / "gmm_fp8.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_grouped_matmul", "--shapes=4x40x64x32", "--fp8",
                           "--check", "--fp8_recipe=delayed", "--min_time_s=0.001", "--dists=balanced,empty",
                           "--noragged_dot", "--tilings=16x32x32w4s3,16x16x16w4s3", f"--json_out={out}"],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": "."})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "check: all PASS" in proc.stdout
    report = json.loads(out.read_text())
    assert {r["impl"] for r in report["main"]} == {"dense jnp.dot (ceiling)", "dense fp8 (ceiling)", "pallas",
                                                   "pallas fp8 delayed", "fp8 kernels mma=auto"}
    assert all(r["ok"] for r in report["check"]) and {r["reference"] for r in report["check"]} == {
        "fp8 reference (xla)"}
    assert report["best_tiles"]["4x40x64x32"] == {k: "16x32x32w4s3" for k in ("forward", "dgrad", "wgrad")}
    assert "FP8 dots need block_k >= 32" in proc.stdout  # the 16-deep tile is refused, not run
