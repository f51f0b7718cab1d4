"""The attention dispatch: capability table, explicit choices checked (never replaced), clear errors, logging."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mjax.kernels import attention
from mjax.kernels.attention import AttentionUnsupported, choose_impl, dot_product_attention, reference_attention

GPU_BF16 = dict(backend="gpu", dtype=jnp.bfloat16, head_dim=128, segment_ids=False, return_lse=False)


@pytest.mark.parametrize("facts,want", [
    (dict(), "cudnn"),
    (dict(dtype=jnp.float16, head_dim=64), "cudnn"),
    (dict(sliding_window=4096), "cudnn"),
    (dict(segment_ids=True), "pallas"),
    (dict(return_lse=True), "pallas"),
    (dict(segment_ids=True, hopper=True), "mosaic"),
    (dict(return_lse=True, offset=True, hopper=True), "mosaic"),
    (dict(sliding_window=512, causal=False, hopper=True), "mosaic"),
    (dict(hopper=True), "cudnn"),
    (dict(dtype=jnp.float32, hopper=True), "pallas"),
    (dict(head_dim=40, segment_ids=True, hopper=True), "mosaic"),
    (dict(dtype=jnp.float32), "pallas"),
    (dict(sliding_window=512, causal=False), "pallas"),
    (dict(q_len=1, kv_len=4096), "pallas"),
    (dict(head_dim=40), "cudnn"),
    (dict(backend="cpu"), "xla"),
    (dict(backend="cpu", segment_ids=True, return_lse=True), "xla"),
    # --deterministic_mode: cuDNN's attention fails under XLA's deterministic ops
    (dict(deterministic=True, hopper=True), "mosaic"),
    (dict(deterministic=True), "pallas"),
    (dict(deterministic=True, backend="cpu"), "xla"),
])
def test_auto_follows_the_capability_table(facts, want):
    assert choose_impl("auto", **(GPU_BF16 | facts)) == want


@pytest.mark.parametrize("impl,facts,match", [
    ("cudnn", dict(segment_ids=True), "packed documents"),
    ("cudnn", dict(return_lse=True), "log-sum-exp"),
    ("cudnn", dict(backend="cpu"), "needs a GPU"),
    ("cudnn", dict(dtype=jnp.float32), "bfloat16/float16"),
    ("cudnn", dict(sliding_window=128, causal=False), "causal sliding window"),
    ("cudnn", dict(deterministic=True, hopper=True), "deterministic ops"),
    ("pallas", dict(head_dim=512), "head dim"),
    ("pallas", dict(dtype=jnp.int8), "bfloat16/float16/float32"),
    ("pallas", dict(backend="tpu"), "runs on GPU"),
    ("mosaic", dict(), "Hopper GPU"),
    ("mosaic", dict(backend="cpu", hopper=True), "Hopper GPU"),
    ("mosaic", dict(dtype=jnp.float32, hopper=True), "bfloat16/float16"),
    ("mosaic", dict(head_dim=264, hopper=True), "head dim"),
    ("auto", dict(head_dim=512), "--attention_impl=xla"),
    ("flash", dict(), "not one of"),
])
def test_impossible_requests_raise_naming_the_option(impl, facts, match):
    with pytest.raises(AttentionUnsupported, match=match) as err:
        choose_impl(impl, **(GPU_BF16 | facts))
    assert "attention_impl" in str(err.value)


@pytest.mark.parametrize("impl", ["xla", "cudnn", "mosaic", "pallas"])
def test_explicit_choice_is_kept(impl):
    assert choose_impl(impl, **GPU_BF16, hopper=True) == impl


def test_dispatch_on_cpu_runs_each_possible_impl(caplog):
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(ks[0], (1, 40, 4, 32), jnp.float32)
    k = jax.random.normal(ks[1], (1, 40, 2, 32), jnp.float32)
    v = jax.random.normal(ks[2], (1, 40, 2, 32), jnp.float32)
    seg = jnp.sort(jax.random.randint(ks[3], (1, 40), 0, 3), axis=1)
    want, want_lse = reference_attention(q, k, v, segment_ids=seg, return_lse=True)
    attention.dispatch._log_choice.cache_clear()
    with caplog.at_level(logging.INFO, logger="mjax.kernels.attention"):
        for impl in ("auto", "xla", "pallas"):
            out, lse = dot_product_attention(q, k, v, segment_ids=seg, impl=impl, return_lse=True)
            np.testing.assert_allclose(out, want, atol=2e-5, err_msg=impl)
            np.testing.assert_allclose(lse, want_lse, atol=2e-5, err_msg=impl)
    logged = caplog.text
    assert "attention: xla (requested auto)" in logged and "attention: pallas (requested pallas)" in logged
    with pytest.raises(AttentionUnsupported, match="cudnn"):
        dot_product_attention(q, k, v, impl="cudnn")
    with pytest.raises(AttentionUnsupported, match="--attention_impl=mosaic cannot do this call: mosaic needs a Hopper"):
        dot_product_attention(q, k, v, impl="mosaic")
    with pytest.raises(AttentionUnsupported, match="multiple of KV heads"):
        dot_product_attention(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2), impl="pallas")


def test_pallas_through_dispatch_under_jit_and_grad():
    """The layer's path: jit + grad through dot_product_attention(impl='pallas') with packed segment ids."""
    ks = jax.random.split(jax.random.PRNGKey(1), 4)
    q = jax.random.normal(ks[0], (2, 32, 2, 16), jnp.float32)
    k = jax.random.normal(ks[1], (2, 32, 1, 16), jnp.float32)
    v = jax.random.normal(ks[2], (2, 32, 1, 16), jnp.float32)
    seg = jnp.sort(jax.random.randint(ks[3], (2, 32), 0, 3), axis=1)

    def loss(impl):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(dot_product_attention(
            q, k, v, segment_ids=seg, impl=impl, sliding_window=8) ** 2), argnums=(0, 1, 2)))

    for got, want in zip(loss("pallas")(q, k, v), loss("xla")(q, k, v)):
        np.testing.assert_allclose(got, want, atol=5e-5, rtol=5e-5)


def test_deterministic_ops_in_xla_flags_reach_every_call(monkeypatch):
    """A caller that passes no `deterministic` (generation, user code) still skips cuDNN when XLA_FLAGS asks for
    deterministic ops, and an explicit cuDNN is refused by name."""
    from mjax.kernels.attention import dispatch  # noqa: PLC0415

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(dispatch, "is_hopper", lambda: True)
    q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
    choose = lambda impl: dispatch._choose(impl, q, q, causal=True, sliding_window=None,  # noqa: E731
                                           segment_ids=None, return_lse=False, offset=None)
    assert choose("auto") == "cudnn"
    for flag in ("--xla_gpu_deterministic_ops=true", "--xla_gpu_exclude_nondeterministic_ops"):
        monkeypatch.setenv("XLA_FLAGS", f"--xla_gpu_enable_triton_gemm=false {flag}")
        assert choose("auto") == "mosaic", flag
        with pytest.raises(AttentionUnsupported, match="deterministic ops"):
            choose("cudnn")
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=false")
    assert choose("auto") == "cudnn"
