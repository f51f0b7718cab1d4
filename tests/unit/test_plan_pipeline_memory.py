"""The pipeline schedules' memory terms (mjax.plan.pipeline_memory) against hand computations from the schedules'
documented buffers (docs/parallelism.md, mjax/parallel/pipeline*.py): a 1F1B device stashes at most
2 pp - 1 + (vpp - 1) pp stage inputs, a GPipe-order device keeps every tick's chunk (vpp M + pp - 1 ticks)."""

import pytest

from mjax.plan.pipeline_memory import Device, activation_bytes, buffer_slots, hoisted_phases, partial_grad_bytes
from tests.helpers.train_utils import tiny_config

# round numbers so every share divides exactly
D = Device(per_micro=800, fixed=400, head_fixed=40, layer_weights=120, layer_params=1000, layer_grads=1000,
           rest_grads=300, stage_input=10)


def _cfg(layers, **parallel):
    return tiny_config(model=dict(num_layers=layers), parallel=parallel)


@pytest.mark.parametrize("pp,vpp,micro", [(2, 1, 4), (4, 1, 8), (2, 2, 4), (4, 2, 8)])
def test_1f1b_buffers_are_the_stash_twice_and_four_hand_offs(pp, vpp, micro):
    pcfg = _cfg(8, pp=pp, vpp=vpp).parallel
    stash = 2 * pp - 1 + (vpp - 1) * pp  # micro >= that here
    assert buffer_slots(pcfg, micro) == 2 * stash + 1 + 1 + 2  # one arriving slot each way, two in flight


def test_only_a_one_tick_backward_phase_is_hoisted():
    assert hoisted_phases(_cfg(4, pp=2).parallel, 4) == 1  # the cool-down is pp - 1 = 1 tick
    assert hoisted_phases(_cfg(8, pp=4).parallel, 8) == 0  # 3 ticks: a scan XLA keeps
    assert hoisted_phases(_cfg(8, pp=2, vpp=2).parallel, 4) == 0
    assert hoisted_phases(_cfg(4, pp=2, pipeline_schedule="gpipe").parallel, 4) == 0  # no phases


def test_1f1b_keeps_its_buffers_and_one_chunk():
    cfg = _cfg(4, pp=2)  # 2 layers a chunk
    gpu = 10 * 10 + 800 / 2 + 400 / 2
    assert activation_bytes(cfg, 4, D, on_gpu=True) == gpu
    assert activation_bytes(cfg, 4, D, on_gpu=False) == gpu + (800 + 400) / 2  # the hoisted cool-down chunk
    cfg = _cfg(4, pp=4)  # one layer a chunk: its residuals are the transient's layer, not held apart
    assert activation_bytes(cfg, 8, D, on_gpu=True) == (2 * 7 + 4) * 10 + 400 / 4


def test_interleaved_1f1b_adds_the_placed_layers_and_a_sliced_chunk():
    cfg = _cfg(8, pp=2, vpp=2)  # 4 chunks of 2 layers
    gpu = (2 * 5 + 4) * 10 + 800 / 4 + 400 / 4 + 1000 + 1000 / 2
    assert activation_bytes(cfg, 4, D, on_gpu=True) == gpu
    assert activation_bytes(cfg, 4, D, on_gpu=False) == gpu + 2 * 1000  # the placement's transpose targets


def test_gpipe_keeps_every_tick_with_its_chunk_weights():
    cfg = _cfg(4, pp=2, pipeline_schedule="gpipe")
    ticks, weights = 4 + 2 - 1, (400 - 40 + 120) / 2
    assert activation_bytes(cfg, 4, D, on_gpu=True) == ticks * (800 / 2 + weights) + 3 * 4 * 10
    cfg = _cfg(8, pp=2, vpp=2, pipeline_schedule="interleaved")
    ticks, weights = 2 * 4 + 2 - 1, (400 - 40 + 120) / 4
    expected = ticks * (800 / 4 + weights) + 5 * 4 * 10 + 1000
    assert activation_bytes(cfg, 4, D, on_gpu=True) == expected
    assert activation_bytes(cfg, 4, D, on_gpu=False) == expected + 2 * 1000


def test_partial_gradients_are_the_chunks_and_the_per_device_sums():
    cfg = _cfg(4, pp=2)
    assert partial_grad_bytes(cfg, 4, D, on_gpu=True) == 1000 + 300
    assert partial_grad_bytes(cfg, 4, D, on_gpu=False) == 2 * (1000 + 300)  # the inlined phase's zero fill
    cfg = _cfg(8, pp=2, vpp=2)
    assert partial_grad_bytes(cfg, 4, D, on_gpu=False) == 1000 / 2 + 300  # no phase of one tick
