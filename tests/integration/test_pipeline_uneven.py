"""Uneven pipeline stages (8 CPU devices, 7 layers): each of Megatron's layout flags trains as one device does under
gpipe, 1f1b and both interleaved schedules, the stored layers stay split over the pipeline devices, MoE layers see
their masked slots dropped, and a checkpoint saved under an uneven split restores under pp=1 and under another split
with the same eval loss, and continues there as on one device. (FP8 layers' masked slots: with an MTP depth in
tests/integration/test_mtp_pipeline.py.)"""

import jax
import numpy as np
import pytest

from mjax.config.pipeline_layout import stage_layout
from mjax.train.loop import build, checkpointer
from tests.helpers.train_utils import run_steps, tiny_config
from tests.integration.test_pipeline import STEPS, SGD, _assert_same, _eval_sums, _train

# Training runs and compiled steps: the full suite (make test-all) only, not make test.
pytestmark = pytest.mark.slow

NUM_LAYERS = 7


def _config(parallel=None, micro=None, **sections):
    return tiny_config(model=dict(num_layers=NUM_LAYERS), parallel=parallel or {}, optimizer=SGD,
                       train=dict(micro_batch_size=micro), **sections)


@pytest.fixture(scope="module")
def single_device():
    """(losses, params after the last step, params after each step)."""
    snapshots = []
    losses, state, _ = _train(_config(), jax.devices()[:1], snapshots=snapshots)
    return losses, state.params, snapshots


LAYOUTS = {  # (parallel, micro-batch size, the layers of each virtual stage v = c pp + s)
    "pp2_first3_dp4_gpipe": (dict(pp=2, decoder_first_pipeline_num_layers=3, pipeline_schedule="gpipe"), 2,
                             (3, 4)),
    # The embedding and the loss on stages of their own: devices 0 and 3 run masked slots only.
    "pp4_E_and_L_own_stages_dp2_1f1b": (dict(pp=4, pipeline_model_parallel_layout="E|ttt|tttt|L"), 2, (0, 3, 4, 0)),
    "pp2_vpp2_layout_tp2_interleaved_1f1b": (
        dict(pp=2, vpp=2, tp=2, pipeline_model_parallel_layout="Et|tt|tt|ttL"), 2, (1, 2, 2, 2)),
    "pp4_loss_counted_dp2_1f1b": (dict(pp=4, account_for_loss_in_pipeline_split=True), 2, (2, 2, 2, 1)),
    "pp2_vpp2_embedding_counted_fsdp2_interleaved": (
        dict(pp=2, vpp=2, fsdp=2, account_for_embedding_in_pipeline_split=True, pipeline_schedule="interleaved"), 2,
        (1, 2, 2, 2)),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_uneven_layout_matches_single_device(layout, single_device):
    parallel, micro, counts = LAYOUTS[layout]
    cfg = _config(parallel, micro)
    assert stage_layout(cfg.parallel, NUM_LAYERS).counts == counts
    losses, state, _ = _train(cfg)  # also checks the bubble the step counted against the schedule's formula
    # test_pipeline's tolerances (losses rtol 2e-6, params rtol 2e-5 + atol 2e-6). Measured here: these layouts move
    # the losses by <= 7.0e-7 relative and the params by <= 1.2e-7, as dp8 without a pipeline does (7.0e-7, 2.4e-8).
    _assert_same(losses, state.params, *single_device[:2])
    # 7 layers do not divide over pipeline: every stacked weight is still split over it (on another dim), so each
    # device stores 1 / pp of the layers.
    for path, a in jax.tree_util.tree_flatten_with_path(state.params["layers"])[0]:
        assert "pipeline" in jax.tree.leaves(tuple(a.sharding.spec)), (jax.tree_util.keystr(path), a.sharding.spec)


@pytest.fixture(scope="module")
def uneven_checkpoint(tmp_path_factory):
    """pp=2 x dp=4, GPipe, 3 + 4 layers, trained for two steps and saved with the train loop's Checkpointer."""
    directory = str(tmp_path_factory.mktemp("pp2_first3"))
    cfg = _config(LAYOUTS["pp2_first3_dp4_gpipe"][0], 2, checkpoint=dict(save=directory))
    losses, state, setup = _train(cfg, last=STEPS - 1)
    ckpt = checkpointer(setup)
    ckpt.save(STEPS - 1, state, (STEPS - 1) * cfg.train.global_batch_size, wait=True)
    ckpt.close()
    return cfg, losses, state, directory


def test_uneven_checkpoint_restores_at_pp1_and_at_another_split(single_device, uneven_checkpoint):
    """Saved as pp2 (3, 4): the same weights at pp=1 and at pp4 (2, 2, 2, 1) with the loss counted, whose eval loss
    equals the saving split's; the pp4 run continues with the single-device step."""
    ref_losses, ref_params, ref_snapshots = single_device
    saved_cfg, losses, saved, directory = uneven_checkpoint
    _assert_same(losses, saved.params, ref_losses[:-1], ref_snapshots[-2])
    saved_eval = _eval_sums(saved_cfg, build(saved_cfg), saved.params)

    pp1 = _config(checkpoint=dict(load=directory))
    setup = build(pp1)
    state, _ = checkpointer(setup).restore_or_init()
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(saved.params)):
        np.testing.assert_array_equal(a, b)
    # Two programs summing fp32 token losses in another order: 0 (pp1) and 1.0e-7 (pp4) apart here.
    np.testing.assert_allclose(_eval_sums(pp1, setup, state.params), saved_eval, rtol=2e-6)

    pp4 = _config(LAYOUTS["pp4_loss_counted_dp2_1f1b"][0], 2, checkpoint=dict(load=directory))
    setup = build(pp4)
    state, _ = checkpointer(setup).restore_or_init()
    assert int(state.step) == STEPS - 1
    np.testing.assert_allclose(_eval_sums(pp4, setup, state.params), saved_eval, rtol=2e-6)
    last_loss, state, _ = _train(pp4, state=state, first=STEPS - 1)
    _assert_same(losses + last_loss, state.params, ref_losses, ref_params)


MOE_ONLY = dict(num_layers=4, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_first_dense_layers=0,
                moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)  # every layer MoE (as test_moe_train.py's)


def test_uneven_moe_stages_match_single_device():
    """4 MoE layers over pp2 as (1, 3), 1f1b: the masked slots of device 0 add no aux or z-loss and no tokens to the
    router metrics, and the per-layer loads come back in stored order (moe_load_max/min). 4 layers divide over pp2,
    so the stack stays in contiguous blocks and device 0 sends layer 1 to device 1 (the other placement path)."""
    def run(parallel, devices, micro):
        cfg = tiny_config(model=MOE_ONLY, parallel=parallel, optimizer=SGD,
                          train=dict(train_iters=3, global_batch_size=8, micro_batch_size=micro))
        history, state = run_steps(cfg, devices)
        return history, state.params

    ref_history, ref_params = run({}, jax.devices()[:1], 4)
    history, params = run(dict(pp=2, dp=2, decoder_first_pipeline_num_layers=1), jax.devices()[:4], 2)
    assert params["moe_layers"]["attn"]["q_proj"]["kernel"].sharding.spec[0] == "pipeline"
    # float32: the layouts reorder reductions only (test_moe_train.py's tolerances)
    for key in ("loss", "moe_aux_loss", "moe_z_loss", "moe_load_max", "moe_load_min"):
        np.testing.assert_allclose([r[key] for r in history], [r[key] for r in ref_history], rtol=2e-5, err_msg=key)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0],
                            jax.tree.leaves(jax.device_get(ref_params))):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5, err_msg=jax.tree_util.keystr(path))
