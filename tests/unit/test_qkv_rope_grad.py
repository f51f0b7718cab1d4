"""The fused QKV gradient kernel (--qkv_grad_impl=pallas): against a float64 NumPy oracle of RoPE's backward,
against autodiff of the split it replaces, per shard under a mesh, through Triton for an H200, and in training."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mjax.parallel.layout import validate_layout
from mjax.kernels.qkv_rope_grad.pallas import qkv_rope_grad, qkv_rope_grad_local
from mjax.kernels.qkv_rope_grad import split_qkv, split_rotate
from mjax.model.rope import rope_cos_sin
from tests.helpers.gpu_lowering import lower_for_h200

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
BF16_ULP = 2.0**-7  # spacing of bf16 values in [1, 2)


def _case(b=2, t=200, k=2, g=3, h=64, seed=0):
    """Cotangents of (q, k, v) and the angles; t=200 is not a whole number of the kernel's 128-token tiles."""
    keys = jax.random.split(jax.random.key(seed), 3)
    dq = jax.random.normal(keys[0], (b, t, k * g, h), jnp.bfloat16)
    dk = jax.random.normal(keys[1], (b, t, k, h), jnp.bfloat16)
    dv = jax.random.normal(keys[2], (b, t, k, h), jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(t) + 7, (b, t))
    cos, sin = rope_cos_sin(pos, 1.0 / (10000.0 ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)))
    return dq, dk, dv, cos, sin


def _oracle(dq, dk, dv, cos, sin):
    """float64 NumPy: dx1 = dy1 cos + dy2 sin, dx2 = dy2 cos - dy1 sin; laid out [B, T, K, G + 2, H]."""
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    c, s = f(cos)[:, :, None, :], f(sin)[:, :, None, :]

    def back(d):
        half = d.shape[-1] // 2
        d1, d2 = d[..., :half], d[..., half:]
        return np.concatenate([d1 * c + d2 * s, d2 * c - d1 * s], -1)

    b, t, n, h = dq.shape
    k = dk.shape[2]
    q = back(f(dq)).reshape(b, t, k, n // k, h)
    return np.concatenate([q, back(f(dk))[:, :, :, None], f(dv)[:, :, :, None]], axis=3)


@pytest.mark.parametrize("groups", [1, 3])
def test_kernel_matches_the_float64_oracle(groups):
    args = _case(g=groups)
    got = np.asarray(qkv_rope_grad(*args, interpret=True), np.float64)
    want = _oracle(*args)
    assert got.shape == want.shape == (2, 200, 2, groups + 2, 64)
    np.testing.assert_allclose(got, want, rtol=2.0**-8, atol=1e-6)  # bf16 rounding of an f32 result
    np.testing.assert_array_equal(got[:, :, :, -1], want[:, :, :, -1])  # dV passes through unchanged


def test_split_qkv_is_the_split_forward_and_its_gradient_to_one_ulp():
    """Forward bit-equal to slicing + RoPE; backward equal to autodiff of it up to rounding (a product summed in
    another order flips a rare bf16 rounding: at most one ulp, at most 0.1% of the elements)."""
    b, t, k, g, h = 2, 200, 2, 3, 64
    y = jax.random.normal(jax.random.key(5), (b, t, k, g + 2, h), jnp.bfloat16)
    _, _, _, cos, sin = _case()
    want_out, want_vjp = jax.vjp(lambda y: split_rotate(y, cos, sin), y)
    got_out, got_vjp = jax.vjp(lambda y: split_qkv(y, cos, sin), y)
    for got, want in zip(got_out, want_out):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    cts = _case(seed=6)[:3]
    got, want = (np.asarray(f(cts)[0], np.float32) for f in (got_vjp, want_vjp))
    diff = np.abs(got - want)
    assert np.all(diff <= BF16_ULP * np.maximum(np.abs(want), 1.0)) and np.mean(diff > 0) < 1e-3


def test_per_shard_keeps_batch_and_kv_groups_sharded():
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    dq, dk, dv, cos, sin = _case(b=4, t=256, k=2, g=3)
    heads, rows = NamedSharding(mesh, P("data", None, "tensor", None)), NamedSharding(mesh, P("data", None, None))
    placed = [jax.device_put(a, s) for a, s in ((dq, heads), (dk, heads), (dv, heads), (cos, rows), (sin, rows))]
    f = jax.jit(lambda *a: qkv_rope_grad(*a, interpret=True))
    got = f(*placed)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(f(dq, dk, dv, cos, sin), np.float32))
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, P("data", None, "tensor", None, None)), 5)
    hlo = f.lower(*placed).compile().as_text()
    assert not any(c in hlo for c in ("all-gather", "all-to-all", "collective-permute", "all-reduce"))


def test_lowers_through_triton_for_h200():
    b, t, k, g, h = 1, 256, 8, 3, 128  # llama3.2-3b's group and head sizes
    dq = jnp.zeros((b, t, k, g, h), jnp.bfloat16)
    dkv = jnp.zeros((b, t, k, h), jnp.bfloat16)
    angles = jnp.zeros((b, t, h // 2), jnp.float32)
    f = lambda *a: qkv_rope_grad_local(*a, interpret=False)  # noqa: E731
    assert lower_for_h200(f, dq, dkv, dkv, angles, angles) == 1


@pytest.mark.slow  # compile-heavy: several programs (or a train step) compiled
def test_training_with_the_kernel_matches_autodiff_under_tp_sp():
    """The tiny Llama trained 3 steps, tp2 + sp over 8 devices: the kernel (interpreted, per shard) and autodiff's
    concatenate take the same steps, in lockstep from the same state (tests/helpers/lockstep.py), within bf16's one-step
    noise floor; the gradients of the QKV projections, which the kernel computes, each on their own."""
    from tests.helpers.lockstep import BF16_TOL, assert_steps_close, lockstep  # noqa: PLC0415
    from tests.helpers.train_utils import tiny_config  # noqa: PLC0415

    def cfg(impl):
        return tiny_config(model=dict(hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256),
                           execution=dict(qkv_grad_impl=impl),
                           precision={"compute_dtype": "bfloat16"}, parallel=dict(tp=2, sequence_parallel=True),
                           train=dict(global_batch_size=8, seq_length=64, train_iters=3))

    assert_steps_close(lockstep(cfg("xla"), cfg("pallas"), jax.devices()), **BF16_TOL)


@pytest.mark.parametrize("impl", ["xla", "pallas", "auto"])
def test_attention_backward_runs_the_chosen_assembly(impl):
    """--qkv_grad_impl picks the kernel in the attention layer's backward (and only there); auto on this CPU
    takes autodiff's assembly."""
    from flax import nnx  # noqa: PLC0415

    from mjax.config import load_config  # noqa: PLC0415
    from mjax.model.attention import Attention  # noqa: PLC0415

    from mjax.config import ExecutionConfig  # noqa: PLC0415

    cfg = load_config("tiny").replace(model=dict(hidden_size=64, num_attention_heads=4, num_query_groups=2)).model
    attn = Attention(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, execution=ExecutionConfig(qkv_grad_impl=impl),
                     rngs=nnx.Rngs(0))
    x, pos = jnp.ones((2, 16, 64), jnp.bfloat16), jnp.broadcast_to(jnp.arange(16), (2, 16))
    fwd = jax.jit(lambda x: sum(jnp.sum(t.astype(jnp.float32)) for t in attn.project_qkv(x, pos)))
    assert "mjax_qkv_rope_grad" not in str(jax.make_jaxpr(fwd)(x))
    assert ("mjax_qkv_rope_grad" in str(jax.make_jaxpr(jax.grad(fwd))(x))) == (impl == "pallas")


def test_head_dim_the_kernel_cannot_tile_is_a_config_error():
    from mjax.config import ConfigError, load_config  # noqa: PLC0415

    cfg = load_config("tiny").replace(model=dict(kv_channels=96), execution=dict(qkv_grad_impl="pallas"))
    with pytest.raises(ConfigError, match="--qkv_grad_impl=pallas needs half the head dim"):
        validate_layout(cfg, 1)
    validate_layout(cfg.replace(model=dict(kv_channels=128)), 1)


@pytest.mark.parametrize("change", [dict(model=dict(position_embedding_type="learned")),
                                    dict(parallel=dict(tp=4))])  # tiny has 2 KV heads: replicated over tp=4
def test_pallas_where_the_layer_would_not_run_the_kernel_is_a_config_error(change):
    """An explicit --qkv_grad_impl=pallas never silently takes autodiff's path: without RoPE, or with KV
    heads replicated over tp (separate projections), it is refused; auto takes xla there."""
    from mjax.config import ConfigError, load_config  # noqa: PLC0415

    cfg = load_config("tiny").replace(model=dict(num_attention_heads=4, num_query_groups=2),
                                      execution=dict(qkv_grad_impl="pallas"))
    validate_layout(cfg, 8)
    bad = cfg.replace(**change)
    with pytest.raises(ConfigError, match="--qkv_grad_impl=pallas needs RoPE and the fused QKV projection"):
        validate_layout(bad, 8)
    validate_layout(bad.replace(execution=dict(qkv_grad_impl="auto")), 8)


def test_auto_takes_the_kernel_on_a_gpu_when_it_tiles_the_head_dim(monkeypatch):
    from mjax.kernels import qkv_rope_grad as rope  # noqa: PLC0415

    monkeypatch.setattr(rope.jax, "default_backend", lambda: "gpu")
    assert rope.use_qkv_grad_kernel("auto", 128) and rope.use_qkv_grad_kernel("auto", 64)
    assert not rope.use_qkv_grad_kernel("auto", 96) and not rope.use_qkv_grad_kernel("xla", 128)
    monkeypatch.setattr(rope.jax, "default_backend", lambda: "cpu")
    assert not rope.use_qkv_grad_kernel("auto", 128) and rope.use_qkv_grad_kernel("pallas", 128)
