"""The Pallas kernel under a mesh runs per shard, forward and backward (no gather of q/k/v over batch or heads), also
inside the pipeline's shard_map, and equals the reference; rules that split the sequence are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from mjax.kernels.attention import AttentionUnsupported, dot_product_attention, reference_attention
from mjax.sharding import constrain, logical_sharding
from mjax.parallel.mesh import AXES, make_mesh
from mjax.parallel.rules import logical_rules
from tests.helpers.train_utils import tiny_config

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
GATHERS = ("all-gather", "all-to-all", "collective-permute")


def _qkv(key, b, t, n, kv_heads, h):
    keys = jax.random.split(key, 4)
    q = jax.random.normal(keys[0], (b, t, n, h))
    k = jax.random.normal(keys[1], (b, t, kv_heads, h))
    v = jax.random.normal(keys[2], (b, t, kv_heads, h))
    seg = jnp.asarray(np.repeat(np.array([[1] * 20 + [2] * (t - 20)]), b, 0), jnp.int32)
    return q, k, v, seg


def _attention_and_vjp(impl, q, k, v, seg, do, dlse):
    """(out, lse, dq, dk, dv): the forward and the backward of one cotangent for out and for lse."""
    def f(q, k, v):
        return dot_product_attention(q, k, v, segment_ids=seg, impl=impl, return_lse=True)

    (out, lse), vjp = jax.vjp(f, q, k, v)
    return out, lse, *vjp((do, dlse))


def _collectives(hlo: str) -> dict:
    return {c: hlo.count(f" {c}(") for c in (*GATHERS, "all-reduce")}


@pytest.mark.parametrize("tp, kv_heads", [(2, 2), (4, 2), (1, 1)])
def test_pallas_attention_per_shard_equals_reference(tp, kv_heads):
    """The layer's path: q/k/v constrained by the logical rules, then the kernel; K/V heads fewer than tp are
    replicated and each shard slices the one its query heads use."""
    cfg = tiny_config(parallel=dict(tp=tp))
    mesh = make_mesh(cfg)
    q, k, v, seg = _qkv(jax.random.key(tp), 8, 32, 4, kv_heads, 16)
    want_out, want_lse = reference_attention(q, k, v, segment_ids=seg, return_lse=True)

    def f(q, k, v, s):
        q = constrain(q, ("batch", "seq", "heads", "head_dim"))
        k, v = (constrain(x, ("batch", "seq", "kv_heads", "head_dim")) for x in (k, v))
        return dot_product_attention(q, k, v, segment_ids=s, impl="pallas", return_lse=True)

    with logical_sharding(mesh, logical_rules(cfg)):
        f = jax.jit(f)
        hlo = f.lower(q, k, v, seg).compile().as_text()
        out, lse = f(q, k, v, seg)
    np.testing.assert_allclose(out, want_out, atol=2e-5)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5)
    assert not any(_collectives(hlo)[c] for c in GATHERS)  # each shard attends over its own rows and heads


@pytest.mark.slow  # compile-heavy: several programs (or a train step) compiled
@pytest.mark.parametrize("n, kv_heads", [(8, 4), (8, 2), (8, 1), (12, 3)])
def test_forward_and_backward_per_shard_dp2_tp4(n, kv_heads):
    """dp=2 x tp=4: K/V heads split with the query heads (8/4), or whole and sliced per shard (8/2, 8/1), their
    gradients then summed over the tensor axis (the only collective). 12/3 would put query heads of two KV groups
    on one shard (3 heads, groups of 4): the query heads are gathered instead. Values against the reference."""
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    q, k, v, seg = _qkv(jax.random.key(kv_heads), 4, 32, n, kv_heads, 16)
    do = jax.random.normal(jax.random.key(10), q.shape)
    dlse = jax.random.normal(jax.random.key(11), (4, n, 32))
    want = _attention_and_vjp("xla", q, k, v, seg, do, dlse)

    heads = NamedSharding(mesh, P("data", None, "tensor", None))
    kv = NamedSharding(mesh, P("data", None, "tensor" if kv_heads % 4 == 0 else None, None))
    rows = NamedSharding(mesh, P("data", None))
    lse_sharding = NamedSharding(mesh, P("data", "tensor", None))
    placed = [jax.device_put(x, s) for x, s in ((q, heads), (k, kv), (v, kv), (seg, rows), (do, heads),
                                                (dlse, lse_sharding))]
    f = jax.jit(lambda *a: _attention_and_vjp("pallas", *a), out_shardings=(heads, lse_sharding, heads, kv, kv))
    counts = _collectives(f.lower(*placed).compile().as_text())
    got = f(*placed)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5, err_msg=name)
    straddles = n == 12
    assert counts["all-gather"] if straddles else not any(counts[c] for c in GATHERS), counts
    assert (counts["all-reduce"] > 0) == (kv_heads < 4 and not straddles), counts


@pytest.mark.slow  # compile-heavy: several programs (or a train step) compiled
@pytest.mark.parametrize("data, tp", [(2, 2), (1, 4)])
def test_per_shard_inside_the_pipeline_shard_map(data, tp):
    """Inside a shard_map manual over `pipeline` (as the pipeline stages run) the kernel still runs per shard of
    the other axes, forward and backward: 2 KV heads split with the query heads (tp=2), or whole and sliced per
    tensor shard (tp=4). Each stage's attention equals the reference; nothing is gathered."""
    mesh = jax.make_mesh((2, data, tp), ("pipeline", "data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    stages = [_qkv(jax.random.key(s), 4, 32, 8, 2, 16) for s in range(2)]
    q, k, v, seg = (jnp.stack(x) for x in zip(*stages))  # [pp, B, ...]
    do = jax.random.normal(jax.random.key(10), q.shape)
    dlse = jax.random.normal(jax.random.key(11), (2, 4, 8, 32))
    want = jax.vmap(lambda *a: _attention_and_vjp("xla", *a))(q, k, v, seg, do, dlse)

    def stage(q, k, v, seg, do, dlse):
        mesh = jax.sharding.get_abstract_mesh()
        heads, rows = P("data", None, "tensor", None), P("data", None)
        kv = P("data", None, "tensor" if 2 % tp == 0 else None, None)
        placed = [jax.lax.with_sharding_constraint(x[0], NamedSharding(mesh, s)) for x, s in
                  ((q, heads), (k, kv), (v, kv), (seg, rows), (do, heads), (dlse, P("data", "tensor", None)))]
        return tuple(x[None] for x in _attention_and_vjp("pallas", *placed))

    f = jax.jit(jax.shard_map(stage, mesh=mesh, in_specs=P("pipeline"), out_specs=P("pipeline"),
                              axis_names={"pipeline"}, check_vma=False))
    counts = _collectives(f.lower(q, k, v, seg, do, dlse).compile().as_text())
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), f(q, k, v, seg, do, dlse), want):
        np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5, err_msg=name)
    assert not any(counts[c] for c in GATHERS), counts


def test_rules_that_split_the_sequence_are_refused_at_trace_time():
    """--cp > 1 splits the sequence: the whole-sequence kernel refuses at trace time (before any compile)."""
    mesh = jax.make_mesh((1, 2, 1, 1, 2, 2), AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))
    q, k, v, seg = _qkv(jax.random.key(0), 2, 32, 4, 2, 16)
    with logical_sharding(mesh, logical_rules(tiny_config(parallel=dict(tp=2, cp=2)))):
        with pytest.raises(AttentionUnsupported, match="whole sequences.*context-parallel"):
            jax.jit(lambda q, k, v: dot_product_attention(q, k, v, impl="pallas")).trace(q, k, v)


def test_a_sequence_split_by_its_placement_is_gathered():
    """Operands placed with the sequence split (no rule says so) are gathered to whole sequences first: the same
    values, the batch still per shard."""
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    q, k, v, seg = _qkv(jax.random.key(1), 4, 32, 4, 2, 16)
    want = reference_attention(q, k, v, segment_ids=seg)
    split = NamedSharding(mesh, P("data", "tensor", None, None))
    placed = [jax.device_put(x, split) for x in (q, k, v)] + [jax.device_put(seg, NamedSharding(mesh, P("data")))]
    f = jax.jit(lambda q, k, v, s: dot_product_attention(q, k, v, segment_ids=s, impl="pallas"))
    out = f(*placed)
    np.testing.assert_allclose(out, want, atol=2e-5)
    assert _collectives(f.lower(*placed).compile().as_text())["all-gather"] > 0
    assert out.sharding.spec[0] == "data"
