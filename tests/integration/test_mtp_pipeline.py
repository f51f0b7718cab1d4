"""Multi-token prediction under pipeline parallelism (8 CPU devices): the MTP depths run where the head runs (after a
GPipe-order pipeline, or on the last stage inside the 1F1B and zero-bubble ticks), and every schedule gives the
single-device losses, MTP losses and parameters, with context parallelism beside the pipeline too; a V3-shaped
model (a dense first layer, MoE layers) with an MoE MTP block adds the same router metrics and moves its expert bias
as on one device, with expert and tensor parallelism beside the pipeline; delayed FP8 steps like one device with an
MTP depth and uneven stages."""

import jax
import numpy as np
import pytest

from tests.helpers.lockstep import assert_amaxes_match, assert_steps_close, lockstep
from tests.helpers.train_utils import FAST_COMPILE, document_batches, run_steps, tiny_config
from tests.integration.test_mtp_train import MODEL as V3_2_LAYERS

pytestmark = pytest.mark.slow  # compiles a training step per layout

SGD = dict(optimizer="sgd", lr=0.5, weight_decay=0.0, clip_grad=0.0)
DENSE = dict(num_layers=4, mtp_num_layers=1)
# tests/integration/test_mtp_train.py's V3 shape (MLA with YaRN, sigmoid routing with the expert bias) with 4 layers:
# a dense first layer (stage 0 runs dense, MoE; the other MoE, MoE), MoE layers and an MoE depth. Also
# tests/integration/test_mla_parallel.py's model (there without the bias and the depth) under 1f1b x data parallelism.
V3 = dict(V3_2_LAYERS, num_layers=4)
# layout: (parallel, micro-batch size per data shard). Dense: 16 sequences, 2 micro-batches of 8 over the data shards.
DENSE_LAYOUTS = {
    "gpipe_pp2_fsdp2_tp2_sp": (dict(pp=2, fsdp=2, tp=2, sequence_parallel=True, pipeline_schedule="gpipe"), 4),
    "1f1b_pp2_dp2_tp2_layout": (dict(pp=2, tp=2, pipeline_model_parallel_layout="Ett|ttmL"), 4),  # Megatron's m
    "interleaved_pp2_vpp2_dp4": (dict(pp=2, vpp=2, pipeline_schedule="interleaved"), 2),
    "interleaved_1f1b_pp2_vpp2_dp2_tp2": (dict(pp=2, vpp=2, tp=2), 4),
    "zero_bubble_pp2_dp4": (dict(pp=2, pipeline_schedule="zero_bubble"), 2),
    "1f1b_pp2_cp2_dp2": (dict(pp=2, cp=2), 4),  # the depths' tokens ahead under the sequence split
    "gpipe_pp2_cp2_dp2": (dict(pp=2, cp=2, pipeline_schedule="gpipe"), 4),
}
# V3: 12 sequences, 3 micro-batches of 4 over the data x expert shards; gpipe's second head group has a padding slot,
# which must route no tokens. (The MoE schedules: gpipe, 1f1b, interleaved_1f1b.)
V3_LAYOUTS = {
    "gpipe_pp2_ep2_tp2": (dict(pp=2, ep=2, tp=2, pipeline_schedule="gpipe"), 2),
    "1f1b_pp2_dp2_ep2": (dict(pp=2, ep=2), 1),
    "interleaved_1f1b_pp2_vpp2_ep2_tp2": (dict(pp=2, vpp=2, ep=2, tp=2), 3),  # a layer a virtual stage, dense first
}
_REFERENCES = {}


def _run(model, parallel, micro, global_batch, devices):
    # 3 steps: the expert bias's +-rate moves of a flipping load cannot cancel out (test_mtp_train.py)
    cfg = tiny_config(model=model, parallel=parallel, optimizer=SGD, data=dict(reset_attention_mask=True),
                      train=dict(train_iters=3, global_batch_size=global_batch, micro_batch_size=micro))
    history, state = run_steps(cfg, devices, batches=lambda c: document_batches(c, mean_length=12))
    return history, jax.device_get(state.params)


def _check(model, layout, global_batch, keys):
    parallel, micro = layout
    shards = jax.device_count() // int(np.prod([parallel.get(k, 1) for k in ("tp", "cp", "pp")]))
    key = (tuple(sorted(model.items())), micro * shards)  # one device runs the same micro-batches
    if key not in _REFERENCES:
        _REFERENCES[key] = _run(model, {}, micro * shards, global_batch, jax.devices()[:1])
    ref_history, ref_params = _REFERENCES[key]
    history, params = _run(model, parallel, micro, global_batch, jax.devices())
    # fp32 SGD steps: the layouts reorder reductions only (the losses moved by <= 2e-7, the params by <= 1.2e-7)
    for name in keys:
        np.testing.assert_allclose([r[name] for r in history], [r[name] for r in ref_history], rtol=2e-6,
                                   err_msg=name)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=jax.tree_util.keystr(path))
    return params


@pytest.mark.parametrize("layout", DENSE_LAYOUTS)
def test_every_schedule_gives_the_single_device_mtp_steps(layout):
    _check(DENSE, DENSE_LAYOUTS[layout], 16, ("loss", "mtp_1_loss"))


@pytest.mark.parametrize("layout", V3_LAYOUTS)
def test_moe_mtp_block_on_the_last_stage_matches_single_device(layout):
    params = _check(V3, V3_LAYOUTS[layout], 12, ("loss", "mtp_1_loss", "moe_aux_loss", "moe_load_max",
                                                 "moe_load_min"))
    # the MTP block's expert bias moved, by its own router counts (compared above with the single device's)
    assert np.abs(params["mtp"]["layers"]["block"]["mlp"]["router"]["expert_bias"]).max() > 0


def test_fp8_mtp_depth_and_uneven_stages_step_like_one_device():
    """Delayed FP8 with an MTP depth, 3 layers over pp2 x tp2 as (1, 2) (1f1b, Adam): the depth's linear layers, held
    by every pipeline device, get their scales in the last stage's head and their amaxes back from it alone; every
    layer's amaxes come back from the slot that runs it and nothing from device 0's masked slot (which runs a real
    layer's weights). Two steps in lockstep from the single-device state, within test_pipeline.py's FP8 noise floor;
    the weights' amaxes exactly."""
    def cfg(p):
        return tiny_config(model=dict(num_layers=3, mtp_num_layers=1), parallel=p,
                           train=dict(train_iters=2, micro_batch_size=2, seq_length=32),
                           precision=dict(compute_dtype="bfloat16", fp8_recipe="delayed", fp8_amax_history_len=4))

    steps = lockstep(cfg({}), cfg(dict(pp=2, tp=2, decoder_first_pipeline_num_layers=1)), jax.devices()[:1],
                     jax.devices(), compiler_options=FAST_COMPILE)
    assert_steps_close(steps, loss=5e-4, grad_norm=2e-2, grad=0.2)
    assert_amaxes_match(steps)
    assert {k for k in steps[0].want_amax if "mtp" in k}, list(steps[0].want_amax)  # the depth's layers are in it
