"""Expert parallelism (mjax/parallel/token_dispatcher.py) on 8 CPU devices: every layout and both dispatchers give
the single-device losses and weights, capacity is per rank as under data parallelism, the compiled step moves the
routed rows by all-to-all and gathers no batch, a rank with no tokens or all of them is fine, and a checkpoint
moves between ep sizes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mjax.config import load_config
from mjax.model.moe import MoE
from mjax.parallel.mesh import make_mesh
from mjax.parallel.rules import logical_rules
from mjax.parallel.token_dispatcher import TokenDispatcher
from mjax.sharding import logical_sharding, single_device
from mjax.train.loop import build, checkpointer, evaluate, train
from mjax.train.step import make_eval_step
from tests.helpers.train_utils import FAST_COMPILE, initial_state, pattern_batches, tiny_config

# Training runs and compiled steps: the full suite (make test-all) only, not make test.
pytestmark = pytest.mark.slow

SGD = dict(optimizer="sgd", lr=0.5, weight_decay=0.0, clip_grad=0.0)  # params after a step = params - lr * grads
MOE = dict(num_layers=2, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, moe_first_dense_layers=0,
           moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
ALLGATHER = dict(moe_token_dispatcher_type="allgather")
FOLDED = dict(expert_tensor_parallel_size=1)  # the experts over expert x tensor, attention over tensor
# Every layout runs the global batch of 16 as 2 micro-batches, as one device does (the aux loss is per micro-batch).
LAYOUTS = {
    "ep2_dp4": dict(ep=2, dp=4),
    "ep4_tp2": dict(ep=4, tp=2),
    "ep8": dict(ep=8),
    "ep2_fsdp2_tp2_sp": dict(ep=2, fsdp=2, tp=2, sequence_parallel=True),
    "ep2_pp2_tp2": dict(ep=2, pp=2, tp=2),
    "ep2_tp2_folded_dp2": dict(ep=2, tp=2, dp=2, **FOLDED),
    "ep2_dp4_allgather": dict(ep=2, dp=4, **ALLGATHER),
    "ep2_tp2_folded_sp_allgather": dict(ep=2, tp=2, dp=2, sequence_parallel=True, **FOLDED, **ALLGATHER),
}


def _sizes(parallel):
    devices = int(np.prod([v for k, v in parallel.items() if k in ("dp", "tp", "fsdp", "pp", "ep")]))
    return devices, int(np.prod([v for k, v in parallel.items() if k in ("dp", "fsdp", "ep")]))


_programs = {}  # layout -> the compiled step its run took (the default model's)


def _run(parallel, model=MOE, steps=2):
    """train_utils.run_steps, keeping the default model's compiled steps for the HLO test."""
    devices, shards = _sizes(parallel)
    cfg = tiny_config(model=model, parallel=parallel, optimizer=SGD,
                      train=dict(train_iters=steps, global_batch_size=16, micro_batch_size=8 // shards))
    setup = build(cfg, jax.devices()[:devices])
    state, data, history = initial_state(setup), pattern_batches(cfg), []
    batch = setup.place_batch(next(data))
    step, _ = setup.compile_step(state, batch, FAST_COMPILE)
    if model is MOE:
        _programs[tuple(sorted(parallel.items()))] = step
    for _ in range(steps):
        state, metrics = step(state, batch)
        history.append(jax.device_get(metrics))
        batch = setup.place_batch(next(data))
    return history, jax.device_get(state.params), state


_single = {}


def _single_device():
    if not _single:
        _single["run"] = _run({})
    return _single["run"]


def _assert_same_training(history, params, ref_history, ref_params):
    # float32 compute: the layouts reorder reductions only (measured: 2e-7 relative on losses and weights)
    for key in ("loss", "moe_aux_loss", "moe_z_loss", "moe_load_max", "moe_load_min"):
        np.testing.assert_allclose([r[key] for r in history], [r[key] for r in ref_history], rtol=2e-5, err_msg=key)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_parallel_layout_matches_single_device(layout):
    parallel = LAYOUTS[layout]
    ref_history, ref_params, _ = _single_device()
    history, params, state = _run(parallel)
    _assert_same_training(history, params, ref_history, ref_params)
    kernel = state.params["moe_layers"]["mlp"]["experts"]["up_proj"]["kernel"]  # [L, E, D, F]
    entry = kernel.sharding.spec[1]
    split = (entry,) if isinstance(entry, str) else tuple(entry or ())
    assert "expert" in split and ("tensor" in split) == ("folded" in layout), kernel.sharding.spec
    ranks = int(np.prod([kernel.sharding.mesh.shape[a] for a in split]))
    assert kernel.addressable_shards[0].data.shape[1] == MOE["num_experts"] // ranks  # created split, never whole


def test_capacity_is_per_rank_as_under_data_parallelism():
    """With a capacity the dropped tokens depend on the dispatch group: each rank's tokens, the same groups as dp8.
    Padded to capacity: every expert's rows are sent, its kept ones and its padding, so the exchange moves fixed
    blocks of E/ep x capacity rows, dropped assignments included in the count."""
    model = dict(MOE, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    ref_history, ref_params, _ = _run(dict(dp=8), model)
    history, params, _ = _run(dict(ep=4, dp=2), model)
    assert all(r["moe_dropped_fraction"] > 0 for r in history)  # the capacity really drops tokens here
    _assert_same_training(history, params, ref_history, ref_params)
    np.testing.assert_array_equal([r["moe_dropped_fraction"] for r in history],
                                  [r["moe_dropped_fraction"] for r in ref_history])


def _compiled_step_hlo(parallel):
    """The HLO of the layout's compiled train step: its layout test's (or the single-device run's), else trained
    here."""
    key = tuple(sorted(parallel.items()))
    if key not in _programs:
        _single_device() if not parallel else _run(parallel)
    return _programs[key].as_text()


def _ops(hlo, op):
    return [line for line in hlo.splitlines() if re.search(rf"\s{op}(-start)?\(", line)]


def test_alltoall_step_moves_the_routed_rows_and_gathers_no_batch():
    hlo = _compiled_step_hlo(LAYOUTS["ep2_dp4"])
    # One micro-batch sequence per device: n = 32 tokens, R = n * top-2 = 64 rows of D = 64, in blocks per rank.
    blocks = [line for line in _ops(hlo, "all-to-all") if "f32[1,64,64]" in line]
    assert len(blocks) >= 4, _ops(hlo, "all-to-all")  # dispatch and combine, forward and backward
    assert not _ops(hlo, "all-gather"), _ops(hlo, "all-gather")  # dp x ep without fsdp: nothing to gather
    single = _compiled_step_hlo({})
    for op in ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute"):
        assert not _ops(single, op), op


def _moe_layer(num_experts=8):
    cfg = tiny_config(model=dict(MOE, num_experts=num_experts)).model
    return MoE(cfg, dtype=jnp.float32, param_dtype=jnp.float32, dispatcher=TokenDispatcher(), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_all_tokens_on_one_rank_and_none_on_the_others(dispatcher):
    """A router whose logits are all equal picks experts 0 and 1 for every token: rank 0 gets every row, the other
    ranks none. Values and gradients equal the single-device layer's."""
    layer = _moe_layer()
    layer.dispatcher = TokenDispatcher(dispatcher)
    layer.router.kernel[...] = jnp.zeros_like(layer.router.kernel[...])
    graphdef, state = nnx.split(layer)
    x = jax.random.normal(jax.random.key(1), (8, 16, layer.cfg.hidden_size), jnp.float32)

    def loss(state, x):
        y, stats = nnx.merge(graphdef, state)(x)
        return jnp.sum(y * jnp.cos(x)), stats["tokens_per_expert"]

    with single_device():
        (want, counts), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state, x)
    assert counts[0] == counts[1] == x.shape[0] * x.shape[1] and counts[2:].sum() == 0
    cfg = load_config("tiny").replace(model=dict(MOE), parallel=dict(ep=4, dp=2))
    mesh = make_mesh(cfg, jax.devices())
    with logical_sharding(mesh, logical_rules(cfg)):
        (got, got_counts), got_grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state, x)
    np.testing.assert_array_equal(got_counts, counts)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _eval_loss(cfg, devices):
    setup = build(cfg, devices)
    state, _ = checkpointer(setup).restore_or_init()
    batch = next(pattern_batches(cfg, seed=7))
    with setup.sharding():
        eval_fn = jax.jit(make_eval_step(setup.model, cfg))
        batches = [{k: batch[k] for k in ("inputs", "targets", "loss_mask", "positions", "segment_ids")}]
        return evaluate(eval_fn, state.params, batches, setup), jax.device_get(state.params)


def test_a_checkpoint_saved_at_ep4_restores_at_ep2_ep8_and_ep1(tmp_path):
    run = str(tmp_path / "run")
    saved = tiny_config(model=MOE, parallel=dict(ep=4, dp=2), checkpoint=dict(save=run),
                        train=dict(train_iters=2, global_batch_size=8))
    train(saved, data=(pattern_batches(saved), None))
    losses, params = {}, {}
    for name, parallel, devices in (("ep4", dict(ep=4, dp=2), 8), ("ep2", dict(ep=2, dp=4), 8),
                                    ("ep8", dict(ep=8, dp=1), 8), ("ep1", dict(ep=1, dp=1), 1)):
        cfg = saved.replace(parallel=parallel, checkpoint=dict(save=None, load=run))
        losses[name], params[name] = _eval_loss(cfg, jax.devices()[:devices])
    for name in ("ep2", "ep8", "ep1"):
        for a, b in zip(jax.tree.leaves(params[name]), jax.tree.leaves(params["ep4"])):
            np.testing.assert_array_equal(a, b)  # the same weights, whatever the layout
        # float32 reorderings only, as test_pipeline's eval across pp sizes (2.1e-7 apart there)
        np.testing.assert_allclose(losses[name], losses["ep4"], rtol=2e-6)
