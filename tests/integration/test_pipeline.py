"""Pipeline parallelism (8 CPU devices): every schedule and layout gives the single-device losses and gradients,
checkpoints move between pp sizes, 1F1B's activation memory does not grow with micro-batches, bubbles, errors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mjax.parallel.layout import validate_layout
from mjax.train.loop import checkpointer
from mjax.config import ConfigError
from mjax.config.validate import pipeline_schedule
from mjax.sharding import logical_sharding
from mjax.parallel import pipeline
from mjax.parallel.pipeline_tables import one_f_one_b
from mjax.parallel.rules import batch_sharding, logical_rules
from mjax.train.loop import build
from mjax.train.step import make_eval_step, make_train_step
from tests.helpers.lockstep import assert_amaxes_match, assert_steps_close, lockstep
from tests.helpers.train_utils import FAST_COMPILE, initial_state, pattern_batches, tiny_config

# Training runs and compiled steps: the full suite (make test-all) only, not make test.
pytestmark = pytest.mark.slow

SGD = dict(optimizer="sgd", lr=0.5, weight_decay=0.0, clip_grad=0.0)  # params after a step = params - lr * grads
STEPS = 3


def _config(parallel=None, micro=None, **sections):
    return tiny_config(model=dict(num_layers=4), parallel=parallel or {}, optimizer=SGD,
                       train=dict(micro_batch_size=micro), **sections)


def _compiled_step(cfg, setup, state, batch):
    with logical_sharding(setup.mesh, logical_rules(cfg)):
        step = jax.jit(make_train_step(setup.model, cfg, setup.tx, setup.schedule),
                       in_shardings=(setup.state_sharding, setup.batch_sharding),
                       out_shardings=(setup.state_sharding, None))
        return step.lower(state, batch).compile(FAST_COMPILE)


_compiled = {}  # layout (a config without its checkpoint paths), devices -> its compiled step


def _train(cfg, devices=None, state=None, first=0, last=STEPS, snapshots=None):
    """Steps first+1..last of the train loop's step on the synthetic batches; (losses, state, setup), and the params
    after each step appended to `snapshots`. Each layout compiles once: the checkpoint tests train and continue on
    layouts the layout tests run. With pp > 1, also checks the bubble the step measured (useful (device, slot) pairs
    counted at run time) against theory."""
    setup = build(cfg, devices)
    state = initial_state(setup) if state is None else state
    data = pattern_batches(cfg)
    batches = [setup.place_batch(next(data)) for _ in range(last)][first:]
    key = (cfg.replace(checkpoint=dict(save=None, load=None)), tuple(setup.mesh.devices.flat))
    if key not in _compiled:
        _compiled[key] = _compiled_step(cfg, setup, state, batches[0])
    step, losses = _compiled[key], []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        if snapshots is not None:
            snapshots.append(jax.device_get(state.params))
    p = cfg.parallel
    if p.pp > 1:
        expected = pipeline.bubble_fraction(pipeline_schedule(p), p.pp, p.vpp, setup.micro_batches)
        assert float(metrics["pipeline_bubble"]) == pytest.approx(expected, abs=1e-6)
    return losses, state, setup


def _assert_same(losses, params, ref_losses, ref_params):
    # fp32 SGD: GEMM outputs and input gradients moved by up to 4 ulps move 3 steps' losses by <= 2e-7 and the
    # params by <= 1.2e-7 (tests/integration/test_parallel.py); the layouts here the losses by <= 2e-7.
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0],
                            jax.tree.leaves(jax.device_get(ref_params))):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def single_device():
    """(losses, params after the last step, params after each step)."""
    snapshots = []
    losses, state, _ = _train(_config(), jax.devices()[:1], snapshots=snapshots)
    return losses, state.params, snapshots


@pytest.fixture(scope="module")
def pp2_checkpoint(tmp_path_factory):
    """pp=2 x dp=4 (GPipe) trained for two steps and saved with the train loop's Checkpointer."""
    directory = str(tmp_path_factory.mktemp("pp2"))
    cfg = _config(dict(pp=2, pipeline_schedule="gpipe"), micro=2, checkpoint=dict(save=directory))
    losses, state, setup = _train(cfg, last=STEPS - 1)
    ckpt = checkpointer(setup)
    ckpt.save(STEPS - 1, state, (STEPS - 1) * cfg.train.global_batch_size, wait=True)
    ckpt.close()
    return losses, state, directory


LAYOUTS = {  # (parallel, micro-batch size): 2-4 micro-batches of the 16-sample global batch
    "pp2_vpp2_dp2_tp2_interleaved": (dict(pp=2, vpp=2, tp=2, pipeline_schedule="interleaved"), 2),
    "pp2_vpp2_dp2_tp2_interleaved_1f1b": (dict(pp=2, vpp=2, tp=2), 2),  # --vpp alone: interleaved 1F1B
    "pp2_fsdp2_tp2_sp_1f1b": (dict(pp=2, fsdp=2, tp=2, sequence_parallel=True), 2),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_single_device(layout, single_device):
    parallel, micro = LAYOUTS[layout]
    losses, state, _ = _train(_config(parallel, micro))
    _assert_same(losses, state.params, *single_device[:2])
    q = state.params["layers"]["attn"]["q_proj"]["kernel"]  # [L, D, N, H]: layers split over pipeline
    split = [n // s for n, s in zip(q.shape, q.sharding.shard_shape(q.shape))]
    assert split == [parallel["pp"], parallel.get("fsdp", 1), parallel["tp"], 1]


def test_bf16_compute_stays_close_to_the_fp32_single_device_run(single_device):
    """bf16 activations cross the stages (and XLA:CPU once aborted on a bf16 psum of the gpipe/interleaved path)."""
    cfg = _config(LAYOUTS["pp2_vpp2_dp2_tp2_interleaved"][0], 2, precision=dict(compute_dtype="bfloat16"))
    losses, state, _ = _train(cfg)
    # bf16 against fp32 (one device, bf16 with every GEMM's output and input gradients moved by one ulp at random,
    # this layout): the losses 1.4-5.1e-5 apart, the params up to 7.8e-4. Tolerances: 10x, 5x.
    np.testing.assert_allclose(losses, single_device[0], rtol=5e-4)
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(jax.device_get(single_device[1]))):
        np.testing.assert_allclose(a, b, atol=4e-3)


def test_pp2_gpipe_matches_and_its_checkpoint_continues_at_pp4_tp2_1f1b(single_device, pp2_checkpoint):
    ref_losses, ref_params, ref_snapshots = single_device
    losses, saved, directory = pp2_checkpoint
    _assert_same(losses, saved.params, ref_losses[:-1], ref_snapshots[-2])
    cfg = _config(dict(pp=4, tp=2), micro=4, checkpoint=dict(load=directory))
    state, _ = checkpointer(build(cfg)).restore_or_init()
    assert int(state.step) == STEPS - 1
    last_loss, state, _ = _train(cfg, state=state, first=STEPS - 1)
    _assert_same(losses + last_loss, state.params, ref_losses, ref_params)


def _eval_sums(cfg, setup, params):
    """The loop's eval step (through the pipeline when pp > 1) on one global batch."""
    batch = next(pattern_batches(cfg))
    sharding = batch_sharding(setup.mesh, ndim=2, leading=False)
    with logical_sharding(setup.mesh, logical_rules(cfg)):
        step = jax.jit(make_eval_step(setup.model, cfg))
        return [float(x) for x in step(params, jax.device_put(batch, sharding))]


def test_pp2_checkpoint_restores_at_pp1_with_the_same_eval_loss(pp2_checkpoint):
    _, saved, directory = pp2_checkpoint
    cfg = _config(checkpoint=dict(load=directory))
    setup = build(cfg)
    state, _ = checkpointer(setup).restore_or_init()
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(saved.params)):
        assert a.shape == b.shape and "pipeline" not in jax.tree.leaves(a.sharding.spec)
        np.testing.assert_array_equal(a, b)
    pp2 = _config(dict(pp=2, pipeline_schedule="gpipe"), micro=2)
    # Two programs summing fp32 token losses in another order: 2.1e-7 apart here.
    np.testing.assert_allclose(_eval_sums(pp2, build(pp2), saved.params), _eval_sums(cfg, setup, state.params),
                               rtol=2e-6)


def _step_temp_bytes(schedule, pp, num_micro, micro=2, seq=256, vpp=1):
    """XLA's temporary bytes per device of the compiled train step (pp x vpp stages of one layer each, dp=1), and the
    bytes of one stage input [micro, seq, hidden]. Also checks that no stacked layer weight is ever gathered. The
    sequence is long enough that stage inputs, not the tiny fp32 weights' per-step copies, set the peak."""
    cfg = tiny_config(model=dict(num_layers=pp * vpp), parallel=dict(pp=pp, vpp=vpp, pipeline_schedule=schedule),
                      train=dict(global_batch_size=num_micro * micro, micro_batch_size=micro, seq_length=seq))
    setup = build(cfg, jax.devices()[:pp])
    batch = {k: jax.ShapeDtypeStruct((num_micro, micro, seq), jnp.float32 if k == "loss_mask" else jnp.int32,
                                     sharding=setup.batch_sharding) for k in ("inputs", "targets", "loss_mask")}
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), setup.abstract_state,
                         setup.state_sharding)
    compiled = _compiled_step(cfg, setup, state, batch)
    gathered = set(re.findall(r"= \w+\[([\d,]+)\]\{[^}]*\} all-gather", compiled.as_text()))
    stacked = {",".join(map(str, a.shape)) for a in jax.tree.leaves(setup.abstract_state.params["layers"])}
    assert not gathered & stacked, f"stacked layer weights gathered: {gathered & stacked}"
    return compiled.memory_analysis().temp_size_in_bytes, micro * seq * cfg.model.hidden_size * 4


def test_1f1b_activation_memory_grows_with_stages_not_micro_batches():
    one_f, act = {}, None
    for pp, num in ((2, 4), (2, 12), (4, 12)):
        one_f[pp, num], act = _step_temp_bytes("1f1b", pp, num)
    gpipe = {num: _step_temp_bytes("gpipe", 2, num)[0] for num in (4, 12)}
    assert one_f[2, 4] == one_f[2, 12]  # three times the micro-batches, not a byte more
    # The ring of stage inputs waiting for their backward holds 2 pp - 1 of them: 3 -> 7 (all else per device is the
    # same: one layer per stage).
    assert 4 * act <= one_f[4, 12] - one_f[2, 12] <= 8 * act
    # GPipe keeps every micro-batch's activations: far more than one stage input per extra micro-batch.
    assert gpipe[12] - gpipe[4] > 8 * 10 * act


def test_interleaved_1f1b_activation_memory_does_not_grow_with_micro_batches():
    (temp4, act), temp16 = _step_temp_bytes("interleaved_1f1b", 2, 4, vpp=2), _step_temp_bytes("interleaved_1f1b", 2,
                                                                                                16, vpp=2)[0]
    gpipe_order = {num: _step_temp_bytes("interleaved", 2, num, vpp=2)[0] for num in (4, 16)}
    # Four times the micro-batches: the same buffers (what grows is the schedule's int32 index rows, bytes).
    assert abs(temp16 - temp4) < act / 100, (temp4, temp16, act)
    # The GPipe-order interleaving keeps every micro-batch's activations: several stage inputs per extra one.
    assert gpipe_order[16] - gpipe_order[4] > 12 * act


@pytest.mark.parametrize("pp, vpp, num", [(2, 1, 4), (4, 1, 8), (2, 2, 4), (2, 2, 16), (4, 2, 8), (4, 4, 16),
                                          (3, 2, 6)])
def test_1f1b_tables_count_megatrons_bubble_and_bound_the_stash(pp, vpp, num):
    """The schedule tables: every forward and backward of every (chunk, micro-batch) once per device, each backward
    after its forward and its downstream backward, the idle share (pp - 1) / (vpp M + pp - 1), and stage inputs
    kept bounded by pp and vpp (the same for M and 4 M)."""
    tables = one_f_one_b(pp, vpp, num)
    for s in range(pp):
        f = {(c, m): t for t, (c, m) in enumerate(zip(tables.f_chunk[:, s], tables.f_micro[:, s])) if c >= 0}
        b = {(c, m): t for t, (c, m) in enumerate(zip(tables.b_chunk[:, s], tables.b_micro[:, s])) if c >= 0}
        assert set(f) == set(b) == {(c, m) for c in range(vpp) for m in range(num)}
        assert all(f[k] <= b[k] for k in f)
        if s < pp - 1:  # a backward needs the next device's backward of the same virtual stage, a tick before
            nxt = {(c, m): t for t, (c, m) in enumerate(zip(tables.b_chunk[:, s + 1], tables.b_micro[:, s + 1]))
                   if c >= 0}
            assert all(nxt[k] < b[k] for k in b)
    assert tables.bubble() == pytest.approx((pp - 1) / (vpp * num + pp - 1), abs=1e-12)
    assert tables.stash == one_f_one_b(pp, vpp, 4 * num).stash == 2 * pp - 1 + (vpp - 1) * pp


@pytest.mark.parametrize("pp, vpp", [(2, 2), (2, 3), (4, 2), (4, 4), (2, 5)])
def test_interleaved_chunks_hold_megatrons_layers(pp, vpp):
    """Stored blocks (device d holds layers [d L/pp, (d+1) L/pp)) reach chunk c of device s = virtual stage c pp + s."""
    layers_per_chunk, num_layers = 2, 2 * pp * vpp
    mesh = Mesh(np.array(jax.devices()[:pp]), ("pipeline",))
    run = jax.shard_map(lambda a: pipeline.my_chunks({"w": a}, pp, vpp)["w"], mesh=mesh, in_specs=P("pipeline"),
                        out_specs=P("pipeline"))
    chunks = np.asarray(jax.jit(run)(jnp.arange(num_layers))).reshape(pp, vpp, layers_per_chunk)
    for s in range(pp):
        for c in range(vpp):
            v = c * pp + s
            np.testing.assert_array_equal(chunks[s, c], np.arange(v * layers_per_chunk, (v + 1) * layers_per_chunk))


@pytest.mark.parametrize("parallel, sections, message", [
    (dict(pp=3), {}, "num_layers=4 is not divisible by --pp=3 x --vpp=1"),
    (dict(pp=2, vpp=4, pipeline_schedule="interleaved"), {}, "not divisible by --pp=2 x --vpp=4"),
    (dict(pp=3, decoder_last_pipeline_num_layers=1), {}, "decoder_last_pipeline_num_layers=1 leaves 3 .* not split "
     "evenly over the other 2 stage"),
    (dict(pp=2, vpp=2, pipeline_schedule="1f1b"), {}, "--vpp=2 needs an interleaved schedule"),
    (dict(pp=4, vpp=2), dict(model=dict(num_layers=8), train=dict(micro_batch_size=1, global_batch_size=12)),
     "interleaved_1f1b runs the micro-batches in groups of --pp=4"),
    (dict(pp=2, pipeline_schedule="interleaved"), {}, "interleaved needs --vpp >= 2"),
    (dict(vpp=2, pipeline_schedule="interleaved"), {}, "--vpp=2 needs --pp > 1"),
    (dict(pp=2, pipeline_schedule="zb"), {}, "--pipeline_schedule='zb' is not one of"),
    (dict(pp=4), dict(train=dict(micro_batch_size=4)), "2 micro-batch.*fewer than the --pp=4 pipeline stages"),
    (dict(pp=2, pipeline_schedule="gpipe"), dict(precision=dict(fp8_recipe="tensorwise")),
     "--fp8_recipe=tensorwise with --pp=2 runs under --pipeline_schedule=1f1b or interleaved_1f1b"),
])
def test_pipeline_config_errors(parallel, sections, message):
    devices = 6 if parallel.get("pp") == 3 else 8
    cfg = tiny_config(model=dict(num_layers=4), parallel=parallel)
    with pytest.raises(ConfigError, match=message):
        validate_layout(cfg.replace(**sections), devices)


# The scales of every recipe travel one way (delayed also reads them in the forward); interleaving adds their chunk
# placement, blockwise its block scales.
@pytest.mark.parametrize("parallel, recipe", [(dict(pp=2, vpp=2, tp=2), "delayed"), (dict(pp=2, tp=2), "blockwise")],
                         ids=["interleaved_1f1b_delayed", "1f1b_blockwise"])
def test_fp8_stages_take_the_single_device_steps(parallel, recipe):
    """FP8 inside the stages: each layer's scales reach its stage, the amaxes it observes come back (max over
    micro-batches, nothing from idle slots) and move the scaling state as on one device. Two steps in lockstep from
    the single-device state (tests/helpers/lockstep.py), within the FP8 noise floor of test_fp8_train.py's layout
    comparisons; the weights' amaxes exactly."""
    # Blockwise GEMMs need sizes that are multiples of 128: hidden 128, 2 heads (and KV groups) of 64, 128 tokens.
    model = (dict(hidden_size=128, num_attention_heads=2, num_query_groups=2, ffn_hidden_size=256)
             if recipe == "blockwise" else {})

    def cfg(p):
        return tiny_config(model=dict(num_layers=4, **model), parallel=p,
                           train=dict(train_iters=2, micro_batch_size=2, seq_length=64 if model else 32),
                           precision=dict(compute_dtype="bfloat16", fp8_recipe=recipe, fp8_amax_history_len=4))

    steps = lockstep(cfg({}), cfg(parallel), jax.devices()[:1], jax.devices(), compiler_options=FAST_COMPILE)
    assert_steps_close(steps, loss=5e-4, grad_norm=2e-2, grad=0.2)
    assert_amaxes_match(steps)


def test_fused_cross_entropy_on_the_last_stage_matches_single_device(single_device):
    """The chunked output layer + loss runs inside the 1f1b stage's shard_map (its scan carry varies over pipeline)."""
    cfg = _config(dict(pp=2, fsdp=2, tp=2), 2).replace(execution=dict(cross_entropy_impl="fused", cross_entropy_chunk=8))
    losses, state, _ = _train(cfg)
    _assert_same(losses, state.params, *single_device[:2])


def test_pallas_attention_inside_pipeline_stages_matches_single_device(single_device):
    """The per-shard Pallas flash kernel (custom_partitioning, inside each stage's shard_map) trains like the reference
    attention: fp32 on GPU takes this path, as does anything with segment ids."""
    cfg = _config(dict(pp=2, tp=2), 2).replace(execution=dict(attention_impl="pallas"))
    losses, state, _ = _train(cfg)
    np.testing.assert_allclose(losses, single_device[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(jax.device_get(single_device[1]))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_train_loop_logs_the_counted_bubble():
    from mjax.train.loop import train  # noqa: PLC0415

    cfg = _config(dict(pp=2, pipeline_schedule="1f1b"), 2).replace(
        train=dict(train_iters=2), data=dict(mock_data=True), logging=dict(log_interval=1, progress=False))
    from mjax.parallel.layout import resolve_batch  # noqa: PLC0415

    micro = resolve_batch(cfg, jax.device_count()).micro_batches
    record = train(cfg, state=initial_state(build(cfg))).history[-1]
    assert record["pipeline_bubble"] == pytest.approx(pipeline.bubble_fraction("1f1b", 2, 1, micro), abs=1e-6)
