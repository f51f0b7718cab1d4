"""Context-parallel attention (mjax/parallel/context_parallel.py) on 8 CPU devices equals one device's attention.

Oracle: the reference attention over the whole sequence in its natural order, its jax.grad for the gradients; the
context-parallel run gets the same arrays in the load-balanced token order, split over the `context` axis (x tensor
parallelism over heads), and its outputs are put back in natural order before comparing.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mjax.kernels.attention import dispatch, reference_attention
from mjax.parallel.context_parallel import ContextParallelAttention, chunk_ids, load_balance_order
from mjax.sharding import logical_sharding

B, T, H = 2, 64, 16
RULES = {"batch": ("data",), "seq": ("context",), "heads": ("tensor",), "kv_heads": ("tensor",), "head_dim": ()}
# fp32 on both sides; the ring and the merges sum in another order: 4e-6 measured at most, tolerances 10x+.
TOL = dict(atol=5e-5, rtol=1e-5)


def test_load_balance_order_gives_each_rank_a_chunk_from_both_ends():
    order = load_balance_order(16, 4)  # 8 chunks of 2 tokens
    np.testing.assert_array_equal(order.reshape(4, 4), [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11],
                                                        [6, 7, 8, 9]])
    assert sorted(order) == list(range(16))
    # every rank has the same causal work (visible key counts of its queries) in the load-balanced order only
    work = lambda o: (o.reshape(4, 4) + 1).sum(1)  # noqa: E731
    assert len(set(work(order))) == 1
    assert len(set(work(load_balance_order(16, 4, load_balanced=False)))) == 4
    assert chunk_ids(1, 4, load_balanced=False) == (2, 3)


def _inputs(n, k):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(B, T, n, H)).astype(np.float32)
    kv = [rng.normal(size=(B, T, k, H)).astype(np.float32) for _ in range(2)]
    seg = np.sort(rng.integers(0, 4, size=(B, T)), axis=1).astype(np.int32)
    g = rng.normal(size=(B, T, n, H)).astype(np.float32)
    return q, *kv, seg, g


CASES = {  # name: (comm type, a2a group size, cp, tp, heads, kv heads, load balanced)
    "p2p_cp4_tp2": ("p2p", None, 4, 2, 4, 2, True),
    "p2p_cp8_naive": ("p2p", None, 8, 1, 4, 2, False),
    "p2p_cp2_alone": ("p2p", None, 2, 1, 4, 2, True),  # context the only axis that splits: kernels unpartitioned
    "all_gather_cp4_tp2": ("all_gather", None, 4, 2, 4, 2, True),
    "a2a_cp4_tp2_kv_repeated": ("a2a", None, 4, 2, 8, 2, True),
    "a2a_cp2_tp2": ("a2a", None, 2, 2, 8, 4, True),
    "a2a+p2p_cp4_tp2": ("a2a+p2p", 2, 4, 2, 8, 2, True),
}


FAST = {("p2p_cp4_tp2", "causal"), ("p2p_cp4_tp2", "window_and_documents"), ("all_gather_cp4_tp2", "causal"),
        ("a2a_cp4_tp2_kv_repeated", "window_and_documents")}  # the rest: compile-heavy, in make test-all only


@pytest.mark.parametrize("case, masks", [
    pytest.param(c, m, marks=() if (c, m) in FAST else pytest.mark.slow)
    for c in CASES for m in ("causal", "window_and_documents")])
def test_matches_one_device(case, masks, impl="xla"):
    comm, a2a, cp, tp, n, k, balanced = CASES[case]
    window, documents = (None, False) if masks == "causal" else (9, True)
    q, kk, v, seg, g = _inputs(n, k)
    seg = seg if documents else None

    def whole(q, k, v):
        return jnp.sum(reference_attention(q, k, v, causal=True, sliding_window=window, segment_ids=seg) * g)

    want, want_grads = jax.value_and_grad(whole, argnums=(0, 1, 2))(q, kk, v)
    mesh = Mesh(np.array(jax.devices()[:cp * tp]).reshape(1, cp, tp), ("data", "context", "tensor"))
    attention = ContextParallelAttention(comm, a2a, load_balanced=balanced)
    order = load_balance_order(T, cp, balanced)

    def split(q, k, v, seg, g):
        with logical_sharding(mesh, RULES):
            return jnp.sum(attention(q, k, v, causal=True, sliding_window=window, segment_ids=seg, impl=impl) * g)

    placed = [None if x is None else jax.device_put(x[:, order], NamedSharding(mesh, P(None, "context")))
              for x in (q, kk, v, seg, g)]
    got, got_grads = jax.jit(jax.value_and_grad(split, argnums=(0, 1, 2)))(*placed)
    # The loss sums B*T*N*H products of both signs, down to 0.44 from terms whose magnitudes add up to 3477: float32
    # summation noise scales with that magnitude, not the sum (measured up to 1.9e-8 of it, on two XLA:CPUs).
    terms = float(jnp.sum(jnp.abs(reference_attention(q, kk, v, causal=True, sliding_window=window,
                                                      segment_ids=seg) * g)))
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5, atol=2.0**-22 * terms)
    for name, a, b in zip("qkv", got_grads, want_grads):
        np.testing.assert_allclose(np.asarray(a), b[:, order], **TOL, err_msg=f"d{name}")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["p2p_cp4_tp2", "a2a+p2p_cp4_tp2", "p2p_cp2_alone"])
def test_pallas_blocks_match_one_device(case):
    """The same through the Pallas kernel (interpret mode): traced offsets and the blockwise backward."""
    test_matches_one_device(case, "window_and_documents", impl="pallas")


@pytest.mark.parametrize("case", ["p2p_cp4_tp2", "all_gather_cp4_tp2", "a2a_cp4_tp2_kv_repeated", "a2a+p2p_cp4_tp2"])
def test_a_deterministic_run_makes_every_kernel_choice_knowing_it(case, monkeypatch):
    """Compiled with deterministic ops (--deterministic_mode), every attention choice of the forward and the
    backward, ring blocks included, knows it (it then skips cuDNN's attention, which fails under them)."""
    comm, a2a, cp, tp, n, k, balanced = CASES[case]
    real_choose, facts = dispatch.choose_impl, []

    def recording_choose(impl, **f):
        facts.append(f["deterministic"])
        return real_choose(impl, **f)

    monkeypatch.setattr(dispatch, "choose_impl", recording_choose)
    q, kk, v, seg, g = _inputs(n, k)
    mesh = Mesh(np.array(jax.devices()[:cp * tp]).reshape(1, cp, tp), ("data", "context", "tensor"))
    attention = ContextParallelAttention(comm, a2a, load_balanced=balanced, deterministic=True)

    def loss(q, k, v):
        with logical_sharding(mesh, RULES):
            return jnp.sum(attention(q, k, v, causal=True, segment_ids=seg) * g)

    jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, kk, v)  # the choices are made while tracing
    assert facts and all(facts), facts
