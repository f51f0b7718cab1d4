"""FP8/FP4 through the model and the train step: config errors, per-layer amax "gradients" under scan with bf16
first/last layers, delayed-scaling state updated each step and checkpointed, and a convergence check.

Convergence: a 2-layer model (hidden 128) trained STEPS steps on the learnable pattern data of train_utils, bf16
against each FP8 recipe and FP4 recipe. Stated tolerance: the mean loss of each window of 10 steps stays within
WINDOW_TOL of bf16's, and the last window within FINAL_TOL (bf16 goes from 4.85 to about 3.3 here).

Two programs are compared one step at a time from the same state (tests/helpers/lockstep.py) where they should agree to
rounding; free-running trajectories drift apart by more than that."""

import jax
import ml_dtypes
import jax.numpy as jnp
import numpy as np
import pytest

from mjax.parallel.layout import validate_layout
from mjax.config import ConfigError
from mjax.model import build_model
from mjax.sharding import single_device
from mjax.train.optimizer import lr_schedule, make_optimizer
from mjax.train.state import TrainState
from mjax.train.step import make_train_step
from tests.helpers.compile_options import STEP_COMPILE
from tests.helpers.lockstep import assert_steps_close, lockstep
from tests.helpers.train_utils import FAST_COMPILE, initial_state, pattern_batches, tiny_config

# Training runs and compiled steps: the full suite (make test-all) only, not make test.
pytestmark = pytest.mark.slow

# Measured: each recipe's window means (this CPU, and with every GEMM's output and input gradients moved by one ulp
# at random, 17 runs) stay within 0.058 of bf16's, the last window within 0.031; bf16 against itself so moved: 0.011.
STEPS, WINDOW_TOL, FINAL_TOL = 50, 0.15, 0.1
RECIPES = {"bf16": {}, "delayed": dict(fp8_recipe="delayed", fp8_amax_history_len=4),
           "tensorwise": dict(fp8_recipe="tensorwise"), "blockwise": dict(fp8_recipe="blockwise"),
           "nvfp4": dict(fp4_recipe="nvfp4"), "nvfp4_stochastic": dict(fp4_recipe="nvfp4", fp4_stochastic_rounding=True),
           "mxfp4": dict(fp4_recipe="mxfp4", fp4_hadamard=True),
           # the output layer in FP8 too, through the fused loss
           "tensorwise_fp8_head": dict(fp8_recipe="tensorwise", quantize_output_layer=True,
                                       execution=dict(cross_entropy_impl="fused"))}


def _cfg(model=None, execution=None, **precision):
    return tiny_config(model=dict(hidden_size=128, num_attention_heads=2, num_query_groups=2, ffn_hidden_size=256,
                                  **(model or {})),
                       precision={"compute_dtype": "bfloat16", **precision}, execution=execution or {},
                       train=dict(global_batch_size=8, seq_length=32, train_iters=STEPS),
                       optimizer=dict(lr=5e-3))


@pytest.mark.parametrize("precision,match", [
    (dict(fp8_recipe="tensorwise", fp4_recipe="nvfp4"), "choose one"),
    (dict(fp8_recipe="fp8"), "--fp8_recipe='fp8' is not one of"),
    (dict(fp4_stochastic_rounding=True), "--fp4_stochastic_rounding applies to FP4 GEMMs"),
    (dict(fp8_recipe="blockwise", compute_dtype="float16"), "--bf16"),
    (dict(fp8_recipe="delayed", first_last_layers_bf16=True, num_layers_at_end_in_bf16=1,
          num_layers_at_start_in_bf16=1), "at least one"),
])
def test_config_errors(precision, match):
    with pytest.raises(ConfigError, match=match):
        validate_layout(_cfg(**precision), 1)


def test_blockwise_config_names_the_sizes():
    cfg = _cfg(fp8_recipe="blockwise")
    with pytest.raises(ConfigError, match=r"multiples of 128: --ffn_hidden_size=192; "):
        validate_layout(cfg.replace(model=dict(ffn_hidden_size=192)), 1)
    with pytest.raises(ConfigError, match=r"tokens per micro-batch\)=\d+; "):
        validate_layout(cfg.replace(train=dict(seq_length=24)), 1)
    head = _cfg(fp8_recipe="blockwise", quantize_output_layer=True).replace(model=dict(vocab_size=150))
    with pytest.raises(ConfigError, match=r"the padded vocab.*=192"):
        validate_layout(head.replace(model=dict(make_vocab_size_divisible_by=64)), 1)
    validate_layout(head, 1)  # padded to 256


@pytest.mark.parametrize("untied", [False, True])
def test_quantize_output_layer_runs_the_head_in_fp8_tied_or_not(untied):
    """--quantize_output_layer puts the output layer through the FP8 GEMM (the tied embedding's table too): it gets
    a scale variable that observes (amax of h, amax of the weight, amax of the logits' gradient), and the logits are
    the product of h and the weight each cast to e4m3 with its tensor scale (a NumPy / ml_dtypes oracle)."""
    cfg = _cfg(fp8_recipe="tensorwise").replace(model=dict(untie_embeddings_and_output_weights=untied))
    quantized = build_model(cfg.model, cfg.replace(precision=dict(quantize_output_layer=True)).precision)
    plain = build_model(cfg.model, cfg.precision)
    params, scales = quantized.init(jax.random.key(0)), quantized.init_fp8()
    head = "lm_head" if untied else "embed"
    assert head in scales and head not in plain.init_fp8()
    tokens = jnp.arange(64, dtype=jnp.int32).reshape(2, 32) % 100
    got = np.asarray(quantized.apply(params, tokens, fp8=scales))
    h = np.asarray(quantized.bind(params, scales).hidden_states(tokens), np.float32)  # [B, T, D]
    w = np.asarray(params["lm_head"]["kernel"] if untied else params["embed"]["embedding"].T, np.float32)  # [D, V]

    def cast(a):  # per-tensor e4m3 with scale 448 / amax, rounded down to a power of two -> (dequantized values)
        scale = 2.0 ** np.floor(np.log2(np.float32(448.0) / np.abs(a).max()))
        return np.clip(a * scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) / scale

    want = cast(h) @ cast(w)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())  # bf16 output rounding
    bf16_head = np.asarray(plain.apply(params, tokens, fp8=plain.init_fp8()))
    err = lambda a: np.linalg.norm(a - want) / np.linalg.norm(want)  # noqa: E731
    assert err(bf16_head) > 5 * err(got)  # the oracle tells the FP8 head from the bf16 one
    amax = jax.grad(lambda s: jnp.sum(quantized.apply(params, tokens, fp8=s) ** 2))(scales)[head]["fp8_meta"]
    np.testing.assert_allclose(amax[:2], [np.abs(h).max(), np.abs(w).max()], rtol=1e-6)
    assert amax[2] > 0


def test_layer_amaxes_stack_per_layer_and_bf16_layers_observe_nothing():
    cfg = _cfg(fp8_recipe="tensorwise", first_last_layers_bf16=True).replace(model=dict(num_layers=3))
    model = build_model(cfg.model, cfg.precision, cfg.execution)
    params, scales = model.init(jax.random.key(0)), model.init_fp8()
    assert scales["layers"]["mlp"]["up_proj"]["fp8_meta"].shape == (3, 3)
    assert "lm_head" not in scales  # the output layer stays in bf16 unless --quantize_output_layer
    tokens = jnp.arange(64, dtype=jnp.int32).reshape(2, 32) % 100
    amax = jax.jit(jax.grad(lambda s: jnp.sum(model.apply(params, tokens, fp8=s))))(scales)
    up = np.asarray(amax["layers"]["mlp"]["up_proj"]["fp8_meta"])  # [layers, (x, w, grad)]
    assert (up[[0, 2]] == 0).all() and (up[1] > 0).all()
    # gate and up run as one GEMM: both observe the amax of the concatenated weight
    mlp = params["layers"]["mlp"]
    w_amax = max(np.abs(np.asarray(mlp[p]["kernel"][1])).max() for p in ("gate_proj", "up_proj"))
    np.testing.assert_allclose(up[1, 1], w_amax, rtol=1e-6)
    np.testing.assert_array_equal(up, np.asarray(amax["layers"]["mlp"]["gate_proj"]["fp8_meta"]))


@pytest.fixture(scope="module")
@single_device()  # a module's fixture runs outside conftest's single_device() of each test
def runs():
    """recipe -> (cfg, model, final state, losses, last metrics), each trained STEPS steps from the same params and
    data with the real train step (single device, no mesh: the suite is compile-bound on CPU)."""
    out, params = {}, None
    for name, precision in RECIPES.items():
        cfg = _cfg(**precision)
        model = build_model(cfg.model, cfg.precision, cfg.execution)
        params = model.init(jax.random.key(0)) if params is None else params  # quantization adds no parameters
        schedule = lr_schedule(cfg.optimizer, STEPS)
        tx = make_optimizer(cfg.optimizer, schedule)
        state = TrainState.create(params, tx, jax.random.key(1), cfg.precision, model.init_fp8())
        data, losses, step = pattern_batches(cfg), [], None
        for _ in range(STEPS):
            batch = {k: v[None] for k, v in next(data).items()}  # [1 micro-batch, batch, seq]
            if step is None:
                options = STEP_COMPILE if cfg.precision.fp8_recipe else FAST_COMPILE
                step = jax.jit(make_train_step(model, cfg, tx, schedule)).lower(state, batch).compile(options)
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        out[name] = (cfg, model, state, np.array(losses), jax.device_get(metrics))
        print(name, "windows", np.round(np.array(losses).reshape(-1, 10).mean(1), 3))
    return out


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r != "bf16"])
def test_convergence_close_to_bf16(runs, recipe):
    base, got = runs["bf16"][3], runs[recipe][3]
    windows = np.abs(base.reshape(-1, 10).mean(1) - got.reshape(-1, 10).mean(1))
    assert base[-10:].mean() < base[:10].mean() - 0.8  # bf16 itself learned
    assert windows.max() < WINDOW_TOL and windows[-1] < FINAL_TOL, (recipe, windows)


def test_delayed_state_updates_each_step(runs):
    _, _, state, _, metrics = runs["delayed"]
    hist = np.asarray(state.fp8.amax_history["layers"]["attn"]["q_proj"]["fp8_meta"])  # [layers, H=4, 3]
    scales = np.asarray(state.fp8.scales["layers"]["attn"]["q_proj"]["fp8_meta"])
    assert hist.shape == (2, 4, 3) and (hist > 0).all()  # four distinct recent steps recorded
    assert not np.allclose(hist[:, 0], hist[:, 1])
    np.testing.assert_allclose(scales, np.array([448, 448, 57344]) / hist[:, 0], rtol=1e-6)  # most_recent
    assert metrics["fp8_nonfinite_amax"] == 0 and np.isfinite(metrics["fp8_scale_max"])
    assert runs["bf16"][2].fp8 is None and runs["nvfp4"][2].fp8 is None


def test_fp8_state_survives_checkpoint(runs, tmp_path):
    from mjax.train.loop import checkpointer
    from mjax.train.loop import build

    cfg, _, state, _, _ = runs["delayed"]
    cfg = cfg.replace(checkpoint=dict(save=str(tmp_path), async_save=False))
    setup = build(cfg, jax.devices()[:1])
    saver = checkpointer(setup)
    saver.save(STEPS, state, STEPS * cfg.train.global_batch_size)
    saver.close()
    load = cfg.replace(checkpoint=dict(save=None, load=str(tmp_path)))
    restored, consumed = checkpointer(setup, load).restore_or_init()
    assert consumed == STEPS * cfg.train.global_batch_size and int(restored.step) == STEPS
    for a, b in zip(jax.tree.leaves(state.fp8), jax.tree.leaves(restored.fp8), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _reduce_max_count(jaxpr) -> int:
    from jax.extend import core as jcore  # noqa: PLC0415

    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "reduce_max"
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                if isinstance(sub, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                    n += _reduce_max_count(getattr(sub, "jaxpr", sub))
    return n


def test_remat_fp8_cast_keeps_the_quantized_operands_instead_of_recomputing_them():
    """Selective remat recomputes each linear layer's amaxes and casts in the backward unless fp8_cast is kept
    (named, or by --fp8_keep_casts, the default). Keeping it leaves the forward as it is; the gradients move within
    FP8 rounding (the recomputed bf16 inputs need not round to the same FP8 values as the forward's, the kept ones
    are the forward's)."""
    from mjax.train.loop import build  # noqa: PLC0415

    batch = next(pattern_batches(_cfg()))
    out, programs = {}, {}
    for key, names, keep in (("attn_out", ("attn_out",), False), ("fp8_cast", ("attn_out", "fp8_cast"), False),
                             ("default", ("attn_out",), True)):
        cfg = _cfg(fp8_recipe="tensorwise", fp8_keep_casts=keep).replace(
            model=dict(num_layers=2), execution=dict(remat_policy="selective", remat_save_names=names, scan_layers=False))
        setup = build(cfg, jax.devices()[:1])
        state = initial_state(setup, 0)
        placed = setup.place_batch(batch)
        step = make_train_step(setup.model, cfg, setup.tx, setup.schedule)
        jaxpr = jax.make_jaxpr(step)(state, placed)
        programs[key] = str(jaxpr)
        if key != "default":  # the default's program is fp8_cast's (asserted below): nothing more to run
            compiled, _ = setup.compile_step(state, placed, FAST_COMPILE)
            _, metrics = compiled(state, placed)
            out[key] = _reduce_max_count(jaxpr.jaxpr), float(metrics["loss"]), float(metrics["grad_norm"])
    assert programs["default"] == programs["fp8_cast"]  # --fp8_keep_casts keeps exactly what naming fp8_cast does
    linears = 2 * 4  # layers x GEMMs (fused qkv, o, fused gate/up, down)
    assert out["attn_out"][0] - out["fp8_cast"][0] >= 2 * linears  # an x and a w amax each, no longer recomputed
    # Two programs (the remat differs): the same forward, up to another summation order, and FP8 gradients within
    # one step's noise floor (LOCKSTEP_TOL's: loss 6.4e-5, grad norm 2e-3; here 0 and 4.6e-5 apart).
    np.testing.assert_allclose(out["attn_out"][1], out["fp8_cast"][1], rtol=5e-4)
    np.testing.assert_allclose(out["attn_out"][2], out["fp8_cast"][2], rtol=2e-2)


# One step's noise floor of the XLA reference under tp2+sp (tests/helpers/lockstep.py: one-ulp moves of each quantized
# GEMM's output and input gradients, and its tp1 layout), over 3 steps:
#   FP8 (tensorwise, delayed, blockwise): loss 6.4e-5, grad norm 2.0e-3, gradients 3.5e-2 (6.1e-2 at delayed's first
#   step: its initial scales of 1 leave the small gradients of the fused QKV GEMM in e5m2's subnormals), the x and
#   gradient amaxes 4.9e-2 (a few bf16 ulps of the largest element);  NVFP4: loss 2.6e-4, grad norm 3.6e-3,
#   gradients 8.8e-2.
# The Pallas path sits inside that band (FP8: loss <= 5.7e-5, gradients <= 5.6e-2; NVFP4 bit-equal on this CPU).
# Tolerances: 8-10x the band for loss and grad norm, 3-5x for the gradients and amaxes; the weight's amax is the max
# of the same f32 weights in any order: exact. Kernel bugs tried against them: a tile's transpose written with its
# rows reversed (gradients 1.0 apart), a scale off by 2 (gradients 1.3, x amax 35x), e5m2 saturating at 448
# (gradients 0.95 from step 2), an amax of the scaled tile (weight amax 4095x), the block GEMM taking the next
# k-block's scales (grad norm 3e-2, gradients 0.26-0.32). An NVFP4 block scale off by 2 (one bit coarser) stays
# inside FP4's noise here (loss 1e-3, gradients 0.18): the kernel's own test catches it.
LOCKSTEP_TOL = {"fp8": dict(loss=5e-4, grad_norm=2e-2, grad=0.2), "fp4": dict(loss=2e-3, grad_norm=3e-2, grad=0.4)}


@pytest.mark.parametrize("recipe", [dict(fp8_recipe="tensorwise"), dict(fp8_recipe="delayed"),
                                    dict(fp8_recipe="blockwise"), dict(fp4_recipe="nvfp4")])
def test_pallas_kernels_under_tp_sp_match_the_xla_reference(recipe):
    """--quant_impl=pallas (the kernels interpreted, each on its device's shard) with the layers sharded tp2 + sp
    over 8 devices takes the steps the pure-JAX reference takes under the same layout (which GSPMD partitions
    itself): 2 steps in lockstep, each from the reference's state (free-running, two layouts of the reference
    itself are 1.5-3e-3 apart in the loss by step 3); the second runs on trained weights and, with delayed scaling,
    the scales of the first step's amaxes. Loss, gradient norm, gradients and the amaxes each GEMM observed, within
    the noise floor above."""
    def cfg(impl):
        return _cfg(**recipe, quant_impl=impl).replace(parallel=dict(tp=2, sequence_parallel=True),
                                                       train=dict(train_iters=2, seq_length=128))

    steps = lockstep(cfg("xla"), cfg("pallas"), jax.devices(), compiler_options=FAST_COMPILE)
    assert_steps_close(steps, **LOCKSTEP_TOL["fp4" if "fp4_recipe" in recipe else "fp8"])
    assert ("fp4_recipe" in recipe) == (steps[0].want_amax is None)
    for i, s in enumerate(steps, 1):
        for layer, want in (s.want_amax or {}).items():  # [..., (x, w, grad)]
            got = s.got_amax[layer]
            np.testing.assert_array_equal(got[..., 1], want[..., 1], err_msg=layer)
            np.testing.assert_allclose(got[..., ::2], want[..., ::2], rtol=0.25, err_msg=f"{layer}, step {i}")
    assert steps[-1].want["loss"] < steps[0].want["loss"] - 0.2  # the reference itself trained (by 0.32 here)


def test_quantized_head_through_the_fused_loss_trains_like_the_reference_loss():
    """--quantize_output_layer with --cross_entropy_impl=fused (the FP8 head inside the chunked loss) against the
    whole-logits loss over the same FP8 head: 5 steps of delayed scaling in lockstep (tests/helpers/lockstep.py), each
    program with its own scaling state. (The fused loss observes the logits gradient before the 1 / tokens
    factor: its head's gradient amax is 256x the reference's, and its power-of-two scale gives the same values.)

    Same forward (the reference only rounds its logits to bf16 first); the gradients differ within FP8 rounding
    (f32 vs bf16 logits, a logits-gradient scale per chunk). One step's noise floor, the reference against itself
    with every GEMM's output and input gradients moved by one ulp (3 seeds): loss 3.0e-4, grad norm 3.9e-3,
    gradients 5.6e-2 (FP8 rounding flips, most in the head's cast of the final hidden states), h's amax 3.5e-2; the
    fused loss sits inside (loss <= 1.9e-5, grad norm <= 2.5e-3, gradients <= 5.2e-2). Tolerances: 4.5-8x."""
    def cfg(impl):
        return _cfg(fp8_recipe="delayed", quantize_output_layer=True).replace(
            execution=dict(cross_entropy_impl=impl, cross_entropy_chunk=8), train=dict(train_iters=5))

    steps = lockstep(cfg("reference"), cfg("fused"), jax.devices()[:1], own_fp8=True, compiler_options=FAST_COMPILE)
    assert_steps_close(steps, loss=2e-3, grad_norm=3e-2, grad=0.25)
    for s in steps:
        got, want = (a["['lm_head']['fp8_meta']"] for a in (s.got_amax, s.want_amax))  # the head's (h, w, dz)
        assert got[1] == want[1]
        np.testing.assert_allclose(got[0], want[0], rtol=0.25)
    assert steps[-1].want["loss"] < steps[0].want["loss"] - 0.1
