"""A small DeepSeek-V3-shaped model (MLA with q LoRA and YaRN, sigmoid-routed experts behind a dense layer) trains
to the single-device losses and parameters under tensor and pipeline parallelism (8 CPU devices), and with V3's
router (expert bias, group-limited routing) under all three of pipeline, expert and tensor at once. Under the
pipeline the dense first layer makes stage 0's dense/MoE pattern differ from the others': every stage runs the slots
dense, MoE, MoE and skips the one it holds no layer for (mjax/parallel/pipeline_placement.py).

The same model with the expert bias and an MTP depth runs context, expert x tensor and tensor + sequence parallelism
(tests/integration/test_mtp_train.py: cp2_dp4, ep2_tp2_dp2, tp2_sp_dp4) and 1f1b x data x expert parallelism
(tests/integration/test_mtp_pipeline.py: 1f1b_pp2_dp2_ep2)."""

import jax
import numpy as np
import pytest

from tests.helpers.train_utils import run_steps, tiny_config

pytestmark = pytest.mark.slow  # compiles a training step per layout

MODEL = dict(num_layers=4, num_query_groups=None, multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16,
             qk_head_dim=12, qk_pos_emb_head_dim=8, v_head_dim=12, rope_scaling="yarn", rope_scaling_factor=4.0,
             rope_original_max_positions=8, rope_yarn_mscale_all_dim=1.0, num_experts=4, moe_router_topk=2,
             moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32, moe_first_dense_layers=1,
             moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5)
SGD = dict(optimizer="sgd", lr=0.5, weight_decay=0.0, clip_grad=0.0)
# Same fp32 SGD steps as tests/integration/test_parallel.py: layouts move losses by ~1e-7; tolerances 10x and more.
# DeepSeek-V3's router besides MODEL's sigmoid scores and shared expert: aux-loss-free expert bias, group-limited top-k.
V3_ROUTER = dict(moe_router_enable_expert_bias=True, moe_router_num_groups=2, moe_router_group_topk=1)
# layout: (parallel, model overrides, micro-batch size per data shard). tp2_dp4 runs 2 micro-batches of 8 as the
# interleaved layout does: one single-device run serves both.
LAYOUTS = {"tp2_dp4": (dict(tp=2), {}, 2),
           # mesh pipeline 2 x expert 2 x tensor 2 (data 1); 4 micro-batches of 2 sequences per expert rank, 1f1b
           "pp2_ep2_tp2_v3": (dict(pp=2, ep=2, tp=2), V3_ROUTER, 2),
           # one layer per virtual stage: virtual stage 0 dense, the other three MoE (slots dense, MoE)
           "pp2_vpp2_dp2_tp2_interleaved_1f1b": (dict(pp=2, vpp=2, tp=2), {}, 4),
           # the HF fixture's shape: 3 layers, dense then MoE MoE, stage 0 holding the dense one: the MoE stack's
           # stored blocks (one layer per device) move to device 1, which runs both (slots dense, MoE, MoE)
           "pp2_ep2_tp2_first1_3layers": (dict(pp=2, ep=2, tp=2, decoder_first_pipeline_num_layers=1),
                                          dict(V3_ROUTER, num_layers=3), 2)}
_REFERENCES = {}


def _run(parallel, model, micro, devices):
    cfg = tiny_config(model=dict(MODEL, **model), parallel=parallel, optimizer=SGD,
                      train=dict(train_iters=2, micro_batch_size=micro))
    history, state = run_steps(cfg, devices)
    return [float(m["loss"]) for m in history], jax.device_get(state.params)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_layout_matches_single_device(layout):
    parallel, model, micro = LAYOUTS[layout]
    # One device runs the same micro-batches (the batch is split over data x expert ranks): the expert-bias update
    # and the gradient sums see the same sets of sequences.
    shards = jax.device_count() // int(np.prod([parallel.get(k, 1) for k in ("tp", "cp", "pp")]))
    ref_micro = micro * shards
    key = (tuple(sorted(model.items())), ref_micro)
    if key not in _REFERENCES:
        _REFERENCES[key] = _run({}, model, ref_micro, jax.devices()[:1])
    ref_losses, ref_params = _REFERENCES[key]
    losses, params = _run(parallel, model, micro, jax.devices())
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=jax.tree_util.keystr(path))
