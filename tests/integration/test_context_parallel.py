"""Context parallelism in training (8 CPU devices, sequence 256): every layout and comm type gives the single-device
losses and parameters on packed documents under a sliding window; the compiled steps move what each comm type
should and nothing else; activation memory falls with cp."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mjax.train.loop import build, train
from tests.helpers.compile_options import STEP_COMPILE
from tests.helpers.lockstep import assert_amaxes_match, assert_steps_close, lockstep
from tests.helpers.train_utils import FAST_COMPILE, document_batches, initial_state, run_steps, tiny_config

# Training runs and compiled steps: the full suite (make test-all) only, not make test.
pytestmark = pytest.mark.slow

SEQ = 256
SGD = dict(optimizer="sgd", lr=0.5, weight_decay=0.0, clip_grad=0.0)
# 8 heads over 2 KV heads, so that the all-to-all layouts split heads over tp x cp; window 48 < a chunk's 64 tokens
# at cp2, > the 16 of cp8: windows within, across and beyond chunks.
MODEL = dict(num_attention_heads=8, num_query_groups=2, window_size=48)
DOCUMENTS = dict(reset_attention_mask=True, reset_position_ids=True)
LAYOUTS = {
    "cp2_dp4_p2p": dict(cp=2),
    "cp4_tp2_p2p": dict(cp=4, tp=2),
    "cp4_tp2_a2a+p2p": dict(cp=4, tp=2, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=(2, 2)),
    "cp8_all_gather": dict(cp=8, cp_comm_type="all_gather"),
    "cp8_p2p": dict(cp=8),
    "cp2_tp2_sp_fsdp2_a2a": dict(cp=2, tp=2, sequence_parallel=True, fsdp=2, cp_comm_type="a2a"),
    "cp2_pp2_tp2_p2p": dict(cp=2, pp=2, tp=2),
    "cp2_pp2_tp2_all_gather": dict(cp=2, pp=2, tp=2, cp_comm_type="all_gather"),
}


def _config(parallel, steps=3, model=MODEL):
    return tiny_config(parallel=parallel, optimizer=SGD, model=model, data=DOCUMENTS,
                       train=dict(train_iters=steps, seq_length=SEQ))


_programs = {}


def _program(parallel, devices, model=MODEL):
    """(setup, compiled train step) of _config(parallel, model=model): compiled once in this module, for the runs
    that compare a layout with one device and for the tests that read what its step moves (the compiled HLO).
    -O1 (STEP_COMPILE) for every run alike: the pipelined steps run 3-4x faster than at -O0."""
    key = (repr(parallel), len(devices), repr(model))
    if key not in _programs:
        setup = build(_config(parallel, model=model), devices)
        state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), setup.abstract_state,
                             setup.state_sharding)
        batch = setup.place_batch(next(document_batches(setup.cfg)))
        batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), batch)
        _programs[key] = setup, setup.compile_step(state, batch, STEP_COMPILE)[0]
    return _programs[key]


def _run(parallel, devices, model=MODEL):
    """(losses, params) after 3 steps of the train loop's step on document_batches (as train_utils.run_steps)."""
    setup, step = _program(parallel, devices, model)
    state, data, losses = initial_state(setup), document_batches(setup.cfg), []
    for _ in range(setup.cfg.train.train_iters):
        state, metrics = step(state, setup.place_batch(next(data)))
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state.params)


@pytest.fixture(scope="module")
def single_device():
    return _run({}, jax.devices()[:1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_single_device(layout, single_device):
    """fp32 SGD, 3 steps: the losses 2e-7 apart at most, the params 5e-6 (relative); tolerances 10x and more."""
    ref_losses, ref_params = single_device
    losses, params = _run(LAYOUTS[layout], jax.devices())
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))


MOE = dict(MODEL, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64)


@pytest.fixture(scope="module")
def single_device_moe():
    return _run({}, jax.devices()[:1], MOE)


@pytest.mark.parametrize("parallel", [dict(cp=2, ep=2), dict(cp=2), dict(pp=2, cp=2, ep=2), dict(pp=2, cp=2)],
                         ids=["cp2_ep2_dp2", "cp2_dp4", "pp2_cp2_ep2", "pp2_cp2_dp2"])
def test_moe_matches_single_device(parallel, single_device_moe):
    """cp2 x ep2 x dp2: the token dispatcher's exchange over `expert` beside the ring over `context`, each rank
    routing its own tokens; pp2 x cp2 x ep2: the same nested in the pipeline's shard_map; cp2 x dp4 and pp2 x cp2:
    without ep, each rank dispatching its own tokens to its local experts."""
    (ref_losses, ref_params), (losses, params) = single_device_moe, _run(parallel, jax.devices(), MOE)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6)


def test_fp8_takes_the_single_device_steps():
    """Delayed FP8 with cp2 x tp2: two steps in lockstep from the single-device state, within the FP8 noise floor
    of the other layouts' FP8 comparisons (test_pipeline, test_fp8_train)."""
    def cfg(parallel):
        return tiny_config(model=MODEL, parallel=parallel, train=dict(train_iters=2, seq_length=SEQ),
                           precision=dict(compute_dtype="bfloat16", fp8_recipe="delayed", fp8_amax_history_len=4))

    steps = lockstep(cfg({}), cfg(dict(cp=2, tp=2)), jax.devices()[:1], jax.devices()[:4],
                     compiler_options=FAST_COMPILE)
    assert_steps_close(steps, loss=5e-4, grad_norm=2e-2, grad=0.2)
    assert_amaxes_match(steps)


def _hlo(parallel, model=MODEL):
    """The compiled step of a layout of the runs above on the 8 devices (SGD, batch 16), as HLO text."""
    return _program(parallel, jax.devices(), model)[1].as_text()


def _compiled(parallel, devices, seq=SEQ, batch=8, model=MODEL):
    cfg = tiny_config(parallel=parallel, model=model, data=DOCUMENTS,
                      train=dict(seq_length=seq, global_batch_size=batch))
    setup = build(cfg, devices)
    shape = (1, batch, seq)
    abstract_batch = {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "loss_mask" else jnp.int32,
                                              sharding=setup.batch_sharding)
                      for k in ("inputs", "targets", "loss_mask", "positions", "segment_ids")}
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), setup.abstract_state,
                         setup.state_sharding)
    return setup.compile_step(state, abstract_batch, FAST_COMPILE)[0]


def _collectives(hlo: str, op: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of every `op` result in the HLO text (tuple results: each element)."""
    found = []
    for line in hlo.splitlines():
        match = re.match(rf"\s*(?:ROOT )?%\S+ = (.+?) {op}(?:-start)?\(", line)
        if match:
            found += [(d, tuple(int(x) for x in s.split(",") if x))
                      for d, s in re.findall(r"(\w+)\[([\d,]*)\]", match.group(1))]
    return found


def _has_full_sequence(shape, seq=SEQ):
    return seq in shape or any(shape[i] * shape[i + 1] == seq * 8 for i in range(len(shape) - 1))


@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a"])
def test_each_comm_type_moves_only_what_it_should(comm):
    """cp8 alone (no other axis splits anything, so every collective is context parallelism's or a gradient
    reduction): p2p moves K/V by collective-permute only; all_gather gathers only K/V ([.., seq, KV heads, head
    dim]) and segment ids; a2a exchanges by all-to-all. None gathers the residual stream or Q over the sequence."""
    hlo = _hlo(LAYOUTS["cp8_p2p"] if comm == "p2p" else dict(cp=8, cp_comm_type=comm))  # p2p, all_gather: layouts'
    gathers, permutes, a2as = (_collectives(hlo, op) for op in ("all-gather", "collective-permute", "all-to-all"))
    head_dim = 64 // MODEL["num_attention_heads"]
    if comm == "p2p":
        assert permutes and not gathers and not a2as, (gathers, a2as)
        # what travels is K/V blocks ([B, seq/8, KV heads, head dim]), their segment ids, and dK/dV in fp32
        assert {s[-2:] for d, s in permutes if d != "s32"} == {(2, head_dim)}, permutes
    elif comm == "all_gather":
        assert gathers and not permutes and not a2as, (permutes, a2as)
        floats = [s for d, s in gathers if d != "s32"]
        assert floats and all(s[-2:] == (2, head_dim) and SEQ in s for s in floats), gathers
    else:
        assert a2as and not permutes, permutes
        assert all(d == "s32" for d, _ in gathers), gathers  # only the segment ids are gathered
    assert not any(_has_full_sequence(s) and s[-1] == 64 for _, s in gathers), "the residual stream was gathered"


def test_moe_routes_only_each_ranks_own_tokens():
    """With expert parallelism a context-parallel rank routes and computes the experts of its own T / cp tokens:
    cp2 x ep2 x dp2 (batch 16: 4 sequences per device of 128 tokens, top-2; test_moe_matches_single_device's
    program) moves all-to-all blocks of 1024 rows, never the 2048 of the whole sequences."""
    hlo = _hlo(dict(cp=2, ep=2), MOE)
    blocks = {s for d, s in _collectives(hlo, "all-to-all") if d == "f32" and s[-1] == 64}
    assert (1, 1024, 64) in blocks and (1, 2048, 64) not in blocks, blocks


def test_moe_without_ep_computes_only_each_ranks_own_tokens():
    """cp2 x dp4, every expert local (test_moe_matches_single_device's program): a rank routes and computes the
    experts of its own T / cp tokens, so nothing is gathered over the sequence (before, the dispatch groups split
    the batch only and each rank gathered its sequences' residual stream, [4, 256, 64] here, and computed their
    whole expert work)."""
    hlo = _hlo(dict(cp=2), MOE)
    assert not [s for d, s in _collectives(hlo, "all-gather") if d != "s32"], _collectives(hlo, "all-gather")


def test_tp_sp_fsdp_never_gather_the_residual_stream_over_the_sequence():
    """cp2 x tp2 + SP x fsdp2 (FFN 192, so the residual stream's hidden 64 is told apart from a tensor shard's 96
    FFN columns): sequence parallelism gathers the residual stream over `tensor` only (T / cp tokens per gather);
    no [.., T, .., 64] gather. (GSPMD still gathers the MLP's hidden [.., T, 96] over the sequence once in this
    layout: docs/parallelism.md, costs and limits.)"""
    hlo = _compiled(dict(cp=2, tp=2, sequence_parallel=True, fsdp=2), jax.devices(),
                    model=dict(MODEL, ffn_hidden_size=192)).as_text()
    whole = [s for d, s in _collectives(hlo, "all-gather") if d != "s32" and SEQ in s and s[-1] == 64]
    assert not whole, whole


def test_activation_memory_falls_with_cp():
    """One sequence of 2048 tokens: XLA's temporaries per device at cp = 1, 2, 4 (p2p). The activations split over
    the sequence, so each doubling of cp must at least nearly halve them (the weights here are tiny)."""
    temp = {cp: _compiled(dict(cp=cp), jax.devices()[:cp], seq=2048, batch=1,
                          model=dict(MODEL, window_size=None)).memory_analysis().temp_size_in_bytes
            for cp in (1, 2, 4)}
    assert temp[2] < 0.6 * temp[1] and temp[4] < 0.6 * temp[2], temp


def test_training_logs_the_attention_imbalance_it_removed():
    """cp2 x dp4 on packed documents: every logged step carries the balance of the batch it trained on, the
    busiest rank's attention work over the mean's, as balanced and as loaded."""
    cfg = _config(dict(cp=2), steps=2)
    result = train(cfg, data=(document_batches(cfg, mean_length=30), None), state=initial_state(build(cfg)))
    for record in result.history:
        assert 1.0 <= record["attention_imbalance"] < record["attention_imbalance_before"], record



def _spec_axes(sharding) -> set:
    return {a for entry in sharding.spec if entry for a in ((entry,) if isinstance(entry, str) else entry)}


def test_zero1_splits_the_optimizer_state_over_context_too():
    """Context-parallel ranks hold the same parameters, as data-parallel ranks do: ZeRO-1 splits the Adam moments
    over data x context (Megatron's distributed optimizer over dp x cp); the moments after one step equal one
    device's (tolerances as test_parallel's ZeRO-1 test)."""
    def moments(parallel, devices):
        cfg = tiny_config(parallel=parallel, model=MODEL, train=dict(train_iters=1, seq_length=SEQ))
        adam = run_steps(cfg, devices)[1].opt_state[0]  # optax.adamw: (ScaleByAdamState, ...)
        return adam.mu, adam.nu

    (mu, nu), (ref_mu, ref_nu) = moments(dict(cp=2, use_distributed_optimizer=True), jax.devices()), moments(
        {}, jax.devices()[:1])
    assert {"data", "context"} <= _spec_axes(mu["layers"]["attn"]["q_proj"]["kernel"].sharding)
    for got, want, atol in ((mu, ref_mu, 1e-8), (nu, ref_nu, 1e-9)):
        for a, b in zip(jax.tree.leaves(jax.device_get(got)), jax.tree.leaves(jax.device_get(want))):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=atol)
