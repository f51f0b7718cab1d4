"""Every parallel layout gives the single-device losses and gradients (8 CPU devices)."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from mjax.train.loop import build, train
from tests.helpers.lockstep import BF16_TOL, assert_steps_close, lockstep_each
from tests.helpers.train_utils import (FAST_COMPILE, initial_state, multiprocess_config, pattern_batches, run_steps,
                                       tiny_config)

# Training runs and compiled steps: the full suite (make test-all) only, not make test.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SGD = dict(optimizer="sgd", lr=0.5, weight_decay=0.0, clip_grad=0.0)  # params after a step = params - lr * grads
# fp32 SGD (no sign-like first Adam step), 3 steps: every GEMM's output and input gradients moved by up to 4 ulps at
# random move the losses by <= 2e-7 and the params by <= 1.2e-7, as the layouts do; tolerances are 10x and more.
# (ZeRO-1 splits optimizer state, which SGD has none of: its layouts are tested with Adam below.)
LAYOUTS = {
    "dp8": dict(),
    "fsdp8": dict(fsdp=8),
    "tp2_dp4": dict(tp=2),
    "tp4_sp_dp2": dict(tp=4, sequence_parallel=True),
    "tp2_fsdp2_dp2": dict(tp=2, fsdp=2),
}


def _run(parallel, devices, steps=3):
    history, state = run_steps(tiny_config(parallel=parallel, optimizer=SGD, train=dict(train_iters=steps)), devices)
    return [float(m["loss"]) for m in history], jax.device_get(state.params), state


@pytest.fixture(scope="module")
def single_device():
    return _run({}, jax.devices()[:1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_single_device(layout, single_device):
    ref_losses, ref_params, _ = single_device
    losses, params, state = _run(LAYOUTS[layout], jax.devices())
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=jax.tree_util.keystr(path))
    _check_placement(layout, state)


def _spec(x):
    return tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))


BF16_LAYOUTS = {"tp2_sp": dict(tp=2, sequence_parallel=True), "tp2_fsdp4": dict(tp=2, fsdp=4)}


@pytest.fixture(scope="module")
def bf16_lockstep():
    """layout -> 2 bf16 steps of it in lockstep with one device's (one reference for all of them)."""
    def cfg(parallel):
        return tiny_config(parallel=parallel, precision=dict(compute_dtype="bfloat16"), train=dict(train_iters=2))

    others = [(cfg(p), jax.devices()) for p in BF16_LAYOUTS.values()]
    return dict(zip(BF16_LAYOUTS, lockstep_each(cfg({}), others, jax.devices()[:1], compiler_options=FAST_COMPILE)))


@pytest.mark.parametrize("layout", BF16_LAYOUTS)
def test_bf16_compute_under_tp_sp_and_fsdp_matches_single_device(layout, bf16_lockstep):
    """In bf16 the SwiGLU backward takes the packed (gate, up) word path and the fused projections run sharded: 2
    steps (the second from trained weights and Adam moments) in lockstep with one device's from the same state
    (tests/helpers/lockstep.py; free-running, bf16 Adam steps drift apart by more than one step's rounding), within
    bf16's one-step noise floor."""
    assert_steps_close(bf16_lockstep[layout], **BF16_TOL)


def _check_placement(layout, state):
    """The layout really is distributed the way its name says."""
    q = state.params["layers"]["attn"]["q_proj"]["kernel"]  # [L, D, N, H]
    k = state.params["layers"]["attn"]["k_proj"]["kernel"]  # [L, D, K, H]
    if "fsdp" in layout:
        assert _spec(q)[1] == "fsdp"
    if "tp" in layout:
        assert _spec(q)[2] == "tensor"
        assert _spec(k)[2] == ("tensor" if layout != "tp4_sp_dp2" else None)  # 2 KV heads: replicated over tp=4


def _adam_moments(parallel, devices):
    _, state = run_steps(tiny_config(parallel=parallel, train=dict(train_iters=1)), devices)
    adam = state.opt_state[0]  # optax.adamw: (ScaleByAdamState, ...)
    return adam.mu, adam.nu


def test_zero1_splits_adam_moments_over_data_and_matches_single_device():
    mu, nu = _adam_moments(dict(tp=2, use_distributed_optimizer=True), jax.devices())
    ref_mu, ref_nu = _adam_moments({}, jax.devices()[:1])
    q_mu = mu["layers"]["attn"]["q_proj"]["kernel"]
    assert "data" in jax.tree.leaves(_spec(q_mu)) and "tensor" in jax.tree.leaves(_spec(q_mu))
    # f32 gradients of small entries carry an absolute rounding of the large terms summed into them: the first
    # moments of dp8 / zero1 / one-ulp-moved GEMMs differ from one device's by up to 4.6e-10 (max |mu| 4e-3).
    for got, want, atol in ((mu, ref_mu, 1e-8), (nu, ref_nu, 1e-9)):
        for a, b in zip(jax.tree.leaves(jax.device_get(got)), jax.tree.leaves(jax.device_get(want))):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=atol)


def _compiled_step_hlo(parallel):
    from mjax.sharding import logical_sharding  # noqa: PLC0415
    from mjax.parallel.rules import logical_rules  # noqa: PLC0415
    from mjax.train.step import make_train_step  # noqa: PLC0415

    cfg = tiny_config(parallel=parallel)
    setup = build(cfg)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), setup.abstract_state,
                         setup.state_sharding)
    batch = setup.place_batch(next(pattern_batches(cfg)))
    with logical_sharding(setup.mesh, logical_rules(cfg)):
        step = jax.jit(make_train_step(setup.model, cfg, setup.tx, setup.schedule),
                       in_shardings=(setup.state_sharding, setup.batch_sharding))
        return step.lower(state, batch).compile(FAST_COMPILE).as_text(), setup


def _gathered_shapes(hlo):
    return {tuple(map(int, m.split(","))) for m in re.findall(r"= \w+\[([\d,]+)\]\{[^}]*\} all-gather", hlo) if m}


@pytest.mark.parametrize("sp", [False, True])
def test_tp2_step_has_the_expected_collectives(sp):
    hlo, setup = _compiled_step_hlo(dict(tp=2, sequence_parallel=sp))
    if sp:  # the sequence is gathered before each column-parallel block ([micro-batch 4, seq 32, hidden 64]) and
        # reduce-scattered after each row-parallel one (XLA:CPU lowers that as all-reduce + slice; GPU as
        # reduce-scatter)
        assert (4, 32, 64) in _gathered_shapes(hlo)
        assert "reduce-scatter" in hlo or "all-reduce" in hlo
    else:  # Megatron TP: the row-parallel outputs are all-reduced and nothing is ever gathered
        assert "all-reduce" in hlo and "all-gather" not in hlo
    weights = set()
    for leaf in jax.tree.leaves(setup.model.abstract_params()):
        weights |= {leaf.shape, leaf.shape[1:]}  # stacked and per-layer shapes
    weights = {s for s in weights if len(s) >= 2}
    assert not (_gathered_shapes(hlo) & weights), "a whole weight matrix is all-gathered without FSDP"


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_match_the_single_process_run(tmp_path):
    cfg = multiprocess_config()
    run = train(cfg, data=(pattern_batches(cfg), None), state=initial_state(build(cfg)))
    expected = [r["loss"] for r in run.history]
    port, env = _free_port(), {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "helpers" / "multiprocess_train.py"), str(i), str(port),
                               str(tmp_path / f"{i}.json")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for i in range(2)]
    outputs = [p.communicate(timeout=300)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)[-3000:]
    for i in range(2):
        np.testing.assert_allclose(json.loads((tmp_path / f"{i}.json").read_text()), expected, rtol=2e-6)


def test_the_random_init_does_not_depend_on_the_layout():
    """The layout tests start every layout from one cached init (train_utils.initial_state); this is what makes that
    fair: the sharded init (partitionable RNG, each device drawing only its shard) gives one device's params bitwise."""
    cfg = tiny_config()
    one = jax.device_get(build(cfg, jax.devices()[:1]).init_state(5, FAST_COMPILE).params)
    sharded = jax.device_get(build(cfg.replace(parallel=dict(tp=2, fsdp=2)), jax.devices()).init_state(
        5, FAST_COMPILE).params)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(sharded)[0], jax.tree.leaves(one)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
