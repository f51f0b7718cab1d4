import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from mjax.train.loop import NonFiniteError, build, train
from mjax.train.state import LossScale
from mjax.train.step import make_eval_step
from tests.helpers.train_utils import FAST_COMPILE, initial_state, pattern_batches, tiny_config

# Training runs and compiled steps: the full suite (make test-all) only, not make test.
pytestmark = pytest.mark.slow


SGD = dict(optimizer="sgd", lr=1.0, weight_decay=0.0, clip_grad=0.0)  # params after one step = init - grads


def _one_step(cfg, batch, devices=None, **optimizer):
    cfg = cfg.replace(optimizer={**SGD, **optimizer})
    setup = build(cfg, devices)
    placed = setup.place_batch(batch)
    state = initial_state(setup)
    step, _ = setup.compile_step(state, placed, FAST_COMPILE)
    new_state, metrics = step(state, placed)
    return jax.device_get(new_state.params), jax.device_get(metrics)


@pytest.fixture(scope="module")
def plain_step():
    """(params, metrics) of tiny_config()'s SGD step on its first batch over 8 devices (data-parallel, one
    micro-batch): the reference of the accumulation and remat tests, compiled once."""
    return _one_step(tiny_config(), next(pattern_batches(tiny_config())))


def _trained(cfg):
    """The train loop on the pattern batches, from initial_state."""
    return train(cfg, data=(pattern_batches(cfg), None), state=initial_state(build(cfg)))


def _assert_trees_close(a, b, **tol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


def test_gradient_clipping_scales_the_update_to_clip_over_the_global_norm():
    """Megatron's clip: grads * clip / (global norm + 1e-6), checked against the unclipped SGD step's gradients."""
    cfg, clip = tiny_config(), 0.05
    batch = next(pattern_batches(cfg))
    init = jax.device_get(initial_state(build(cfg.replace(optimizer=SGD), jax.devices()[:1])).params)
    # A large step keeps the fp32 differences p0 - p well above the params' rounding.
    free, m_free = _one_step(cfg, batch, jax.devices()[:1], lr=100.0)
    clipped, m_clipped = _one_step(cfg, batch, jax.devices()[:1], lr=100.0, clip_grad=clip)
    factor = clip / (float(m_free["grad_norm"]) + 1e-6)
    assert factor < 0.5 and m_clipped["grad_norm"] == m_free["grad_norm"]  # the norm is reported before clipping
    for p0, pf, pc in zip(jax.tree.leaves(init), jax.tree.leaves(free), jax.tree.leaves(clipped)):
        np.testing.assert_allclose(p0 - pc, (p0 - pf) * factor, rtol=1e-3, atol=1e-7)


def test_loss_decreases_on_the_tiny_config():
    cfg = tiny_config(train=dict(train_iters=30), logging=dict(log_interval=1, progress=False))
    result = _trained(cfg)
    losses = [r["loss"] for r in result.history]
    # Half the targets copy the current token (learnable), half are uniform: the loss floor is ~ln(127)/2 = 2.4.
    assert losses[0] > 4.5 and np.mean(losses[-5:]) < 3.5, losses
    assert all(np.isfinite(losses))


def test_gradient_accumulation_equals_the_large_batch_step(plain_step):
    batch = next(pattern_batches(tiny_config()))
    assert tiny_config().train.micro_batch_size is None
    big, m_big = plain_step  # 1 micro-batch of 16
    acc, m_acc = _one_step(tiny_config(train=dict(micro_batch_size=1)), batch)  # 2 micro-batches of 8
    single, _ = _one_step(tiny_config(), batch, devices=jax.devices()[:1])  # one device, no accumulation
    np.testing.assert_allclose(m_big["loss"], m_acc["loss"], rtol=1e-6)
    np.testing.assert_allclose(m_big["grad_norm"], m_acc["grad_norm"], rtol=1e-5)
    _assert_trees_close(big, acc, rtol=1e-5, atol=1e-7)
    _assert_trees_close(big, single, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_remat_policies_give_identical_loss_and_grads(policy, plain_step):
    batch = next(pattern_batches(tiny_config()))
    ref, m_ref = plain_step
    got, m_got = _one_step(tiny_config(execution=dict(remat_policy=policy)), batch)
    np.testing.assert_allclose(m_ref["loss"], m_got["loss"], rtol=1e-6)
    np.testing.assert_allclose(m_ref["grad_norm"], m_got["grad_norm"], rtol=1e-5)
    _assert_trees_close(ref, got, rtol=1e-5, atol=1e-7)


def _saved_per_layer(policy, names=("attn_out",), attention_impl="auto"):
    """Residuals the backward pass keeps for the scanned layers (stacked, leading dim = num_layers)."""
    cfg = tiny_config(model=dict(num_layers=3),
                      execution=dict(remat_policy=policy, remat_save_names=names, attention_impl=attention_impl))
    setup = build(cfg, jax.devices()[:1])
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), setup.model.abstract_params())
    tokens = jnp.zeros((2, 32), jnp.int32)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(lambda p: setup.model.apply(p, tokens).sum(), params)
    shapes = re.findall(r"^\w+\[([\d,]+)\] output of scan", out.getvalue(), re.M)
    return [tuple(map(int, s.split(","))) for s in shapes if s.startswith("3,")]


def test_remat_policies_save_what_they_name():
    assert _saved_per_layer("full") == [(3, 2, 32, 64)]  # only each layer's input
    assert sorted(_saved_per_layer("selective")) == [(3, 2, 32, 64)] * 2  # + attn_out
    assert (3, 2, 32, 4, 16) in _saved_per_layer("selective", ("attn_context",))
    ffn = tiny_config().model.ffn_hidden_size  # the fused gate and up projection, saved whole by name
    assert sorted(_saved_per_layer("selective", ("mlp_up",))) == [(3, 2, 32, 64), (3, 2, 32, ffn, 2)]


def test_remat_attn_core_keeps_the_attention_kernel_results():
    """attn_core keeps the flash kernel's output and log-sum-exp, so the backward never reruns the forward kernel."""
    plain = _saved_per_layer("selective", ("attn_out",), attention_impl="pallas")
    core = _saved_per_layer("selective", ("attn_out", "attn_core"), attention_impl="pallas")
    assert (3, 2, 4, 32) not in plain and (3, 2, 4, 32) in core  # lse [layers, B, heads, T]
    assert len(_saved_per_layer("none")) > 10


def test_nonfinite_loss_stops_the_run_naming_the_step():
    cfg = tiny_config(train=dict(train_iters=4))
    with pytest.raises(NonFiniteError, match="at step 2"):
        train(cfg, data=(pattern_batches(cfg, nan_mask_at=1), None), state=initial_state(build(cfg)))


def test_nonfinite_step_is_skipped_by_flag_and_training_continues():
    cfg = tiny_config(train=dict(train_iters=4, on_nonfinite="skip"))
    result = train(cfg, data=(pattern_batches(cfg, nan_mask_at=1), None), state=initial_state(build(cfg)))
    assert result.history[-1]["skipped_steps"] == 1
    assert int(result.state.first_nonfinite_step) == 1
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(result.state.params)))


def test_fp16_dynamic_loss_scale_shrinks_on_overflow_and_trains():
    cfg = tiny_config(train=dict(train_iters=12), precision=dict(compute_dtype="float16",
                                                                 initial_loss_scale=2.0**40, hysteresis=1))
    result = _trained(cfg)
    scales = [r["loss_scale"] for r in result.history]
    assert scales[0] == 2.0**40 and scales[-1] < 2.0**40
    assert result.history[-1]["skipped_steps"] >= 1
    assert np.isfinite(result.history[-1]["loss"])


def test_loss_scale_hysteresis_and_growth():
    class P:
        loss_scale, initial_loss_scale, hysteresis, loss_scale_window, min_loss_scale = None, 1024.0, 2, 3, 1.0

    s = LossScale.create(P)
    s = s.update(jnp.array(False), P, True)
    assert float(s.scale) == 1024.0  # first overflow absorbed by hysteresis
    s = s.update(jnp.array(False), P, True)
    assert float(s.scale) == 512.0
    for _ in range(3):
        s = s.update(jnp.array(True), P, True)
    assert float(s.scale) == 1024.0 and int(s.good_steps) == 0 and int(s.hysteresis_left) == 2


@pytest.mark.parametrize("tied", [True, False])
def test_fused_cross_entropy_gives_the_reference_loss_and_grads(tied):
    model = dict(untie_embeddings_and_output_weights=not tied, vocab_size=100)  # 100 of 128 padded: masked
    batch = next(pattern_batches(tiny_config(model=model)))
    batch["loss_mask"][:, ::3] = 0.0
    ref, m_ref = _one_step(tiny_config(model=model, train=dict(z_loss_coeff=1e-3)), batch)
    got, m_got = _one_step(tiny_config(model=model, execution=dict(cross_entropy_impl="fused", cross_entropy_chunk=12),
                                       train=dict(z_loss_coeff=1e-3)), batch)
    np.testing.assert_allclose(m_got["loss"], m_ref["loss"], rtol=1e-6)
    np.testing.assert_allclose(m_got["z_loss"], m_ref["z_loss"], rtol=1e-6)
    _assert_trees_close(ref, got, rtol=1e-5, atol=1e-7)


def test_fused_cross_entropy_never_holds_the_whole_logits():
    def temp_bytes(impl):
        cfg = tiny_config(model=dict(vocab_size=8192), execution=dict(cross_entropy_impl=impl, cross_entropy_chunk=32),
                          train=dict(global_batch_size=16, seq_length=256))
        setup = build(cfg, jax.devices()[:1])
        state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), setup.abstract_state,
                             setup.state_sharding)
        compiled, _ = setup.compile_step(state, setup.place_batch(next(pattern_batches(cfg))), FAST_COMPILE)
        return compiled.memory_analysis().temp_size_in_bytes

    logits_bytes = 16 * 256 * 8192 * 4  # fp32 [batch, seq, vocab]
    reference, fused = temp_bytes("reference"), temp_bytes("fused")
    assert reference > logits_bytes and fused < reference - logits_bytes // 2, (reference, fused)


def test_evaluation_follows_cross_entropy_impl():
    """The eval step takes the fused loss too: the same loss sums, without the whole logits."""
    def eval_run(impl):
        cfg = tiny_config(model=dict(vocab_size=8192), execution=dict(cross_entropy_impl=impl, cross_entropy_chunk=32),
                          train=dict(global_batch_size=16, seq_length=256))
        setup = build(cfg, jax.devices()[:1])
        params = initial_state(setup, 0).params
        batch = {k: jnp.asarray(v) for k, v in next(pattern_batches(cfg)).items()}
        step = jax.jit(make_eval_step(setup.model, cfg)).lower(params, batch).compile(FAST_COMPILE)
        return [float(x) for x in step(params, batch)], step.memory_analysis().temp_size_in_bytes

    (ref_sums, ref_temp), (fused_sums, fused_temp) = eval_run("reference"), eval_run("fused")
    np.testing.assert_allclose(fused_sums, ref_sums, rtol=1e-5)
    logits_bytes = 16 * 256 * 8192 * 4
    assert ref_temp > logits_bytes and fused_temp < ref_temp - logits_bytes // 2, (ref_temp, fused_temp)


def test_attn_core_policy_keeps_the_cudnn_forward_only_when_named(monkeypatch):
    """cuDNN's forward cannot be traced off GPU; its primitive is what the policy sees there (measured on the H200:
    the forward kernel ran once per layer instead of twice). The policy looks for it on a GPU only."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # noqa: PLC0415

    from mjax.parallel.remat import remat_policy  # noqa: PLC0415

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    prim = cudnn._dot_product_attention_fwd_p_wrapper
    with_core = remat_policy(tiny_config(execution=dict(remat_policy="selective",
                                                        remat_save_names=("attn_core",))).execution)
    without = remat_policy(tiny_config(execution=dict(remat_policy="selective",
                                                      remat_save_names=("attn_out",))).execution)
    assert with_core(prim) and not without(prim)
    assert not with_core(jax.lax.exp_p)
