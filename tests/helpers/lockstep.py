"""Two train-step programs compared one step at a time, each step from the same state: the reference's.

Free-running trajectories of two different programs (another kernel, another layout) mostly measure how fast they
drift apart. Adam's first update is ~lr * sign(g), so a gradient entry near zero flips its update on a last-bit
difference, and bf16 outputs and FP8/FP4 casts turn ulp differences into rounding flips: after 3 steps two layouts
of the same FP8 reference differ by 1.5-3e-3 in the loss, by an amount that depends on the CPU (its reduction
order), as large as many bugs. Stepped from the reference's state, each comparison sees one step's noise, and
later steps still run the programs on trained weights and (delayed scaling) updated FP8 scales.

Noise floors are measured the same way throughout: the reference against itself with every GEMM's output and input
gradients moved by one ulp of their dtype at random (the most another summation order can move a value it rounds;
3 seeds), and against other layouts of itself.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mjax.train.loop import build
from tests.helpers.train_utils import initial_state, pattern_batches

# bf16 compute, tiny Llama, 3 steps (the tests of test_parallel.py and test_qkv_rope_grad.py): one step moved the
# loss by <= 3.4e-5, the gradient norm by <= 1.2e-3, the gradients by <= 1.0e-2 all together and <= 2.0e-2 for any
# one parameter (the output layer's, summed in bf16 over data-parallel shards; single device against dp8, fsdp8,
# tp2+sp, tp4+sp, tp2 x fsdp4, and the one-ulp moves). Tolerances: about 10x.
BF16_TOL = dict(loss=3e-4, grad_norm=1e-2, grad=0.1, leaf=0.2)


@dataclasses.dataclass
class Step:
    want: dict  # the reference's metrics
    got: dict  # the other program's, from the same state and batch
    want_grads: dict  # param path -> the (clipped) gradient the step applied, from Adam's first moment
    got_grads: dict
    want_amax: dict | None  # layer path -> the amaxes its FP8 GEMM observed [..., (x, w, grad)]; None without FP8
    got_amax: dict | None


def rel_err(got: dict, want: dict, keys=None) -> float:
    """|got - want| / |want| over the arrays named in `keys` (default: all), all together."""
    keys = list(want) if keys is None else keys
    return float(np.sqrt(sum(np.sum((np.asarray(got[k], np.float64) - want[k]) ** 2) for k in keys) /
                         sum(np.sum(np.asarray(want[k], np.float64) ** 2) for k in keys)))


def assert_steps_close(steps: list, *, loss: float, grad_norm: float, grad: float, leaf: float | None = None):
    """Each step's loss and gradient norm within rtol `loss` / `grad_norm`; its gradients within relative error
    `grad` all together and `leaf` each parameter on its own."""
    for i, s in enumerate(steps, 1):
        np.testing.assert_allclose(s.got["loss"], s.want["loss"], rtol=loss, err_msg=f"loss, step {i}")
        np.testing.assert_allclose(s.got["grad_norm"], s.want["grad_norm"], rtol=grad_norm,
                                   err_msg=f"gradient norm, step {i}")
        err = rel_err(s.got_grads, s.want_grads)
        assert err < grad, f"step {i}: the gradients are {err:.3g} apart"
        for k in s.want_grads if leaf is not None else ():
            err = rel_err(s.got_grads, s.want_grads, [k])
            assert err < leaf, f"step {i}: the gradient of {k} is {err:.3g} apart"


def assert_amaxes_match(steps: list):
    """FP8 under a layout: every layer's weight amaxes exactly one device's, its input and gradient amaxes within
    rtol 0.25 (one step's bf16 rounding moves an amax by a few ulps at most; 0.25 catches a lost or doubled one)."""
    for i, step in enumerate(steps, 1):
        assert step.want_amax and set(step.got_amax) == set(step.want_amax)
        for layer, want in step.want_amax.items():  # [..., (x, w, grad)]
            got = step.got_amax[layer]
            np.testing.assert_array_equal(got[..., 1], want[..., 1], err_msg=layer)
            np.testing.assert_allclose(got[..., ::2], want[..., ::2], rtol=0.25, err_msg=f"{layer}, step {i}")


def _paths(tree) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _adam_mu(state) -> dict:
    return _paths(jax.device_get(state.opt_state[0].mu))  # optax.adamw's first moment


def _latest_amax(state) -> dict | None:
    if state.fp8 is None:
        return None
    history = _paths(jax.device_get(state.fp8.amax_history))  # [..., H, 3], newest first
    return {k: h[..., 0, :] for k, h in history.items()}


def lockstep(ref_cfg, other_cfg, devices=None, other_devices=None, own_fp8=False, compiler_options=None) -> list[Step]:
    """ref_cfg.train.train_iters steps of the reference on pattern_batches; before each, the other config's step
    runs from a copy of the same state (resharded to its own layout) on the same batch. The configs may differ in
    kernels, layout and devices (other_devices: `devices` unless given), not in the state's structure or shapes;
    both use Adam. own_fp8: the other program carries its own FP8 scaling state from step to step (for programs
    that observe the amax of another tensor, e.g. a gradient before rather than after a constant factor).
    compiler_options: XLA options of both compiles (e.g. train_utils.FAST_COMPILE)."""
    other_devices = devices if other_devices is None else other_devices
    return lockstep_each(ref_cfg, [(other_cfg, other_devices)], devices, own_fp8, compiler_options)[0]


def lockstep_each(ref_cfg, others, devices=None, own_fp8=False, compiler_options=None) -> list[list[Step]]:
    """lockstep() of one reference against each (config, devices) of `others` at once: the reference is compiled
    and stepped once."""
    ref = build(ref_cfg, devices)
    progs = [build(cfg, d) for cfg, d in others]
    beta1 = ref_cfg.optimizer.adam_beta1
    data = pattern_batches(ref_cfg)
    state, compiled, out = initial_state(ref, ref_cfg.train.seed), None, [[] for _ in progs]
    other_fp8 = [state.fp8] * len(progs)
    for _ in range(ref_cfg.train.train_iters):
        batch = next(data)
        placed = [s.place_batch(batch) for s in (ref, *progs)]
        if compiled is None:
            compiled = [s.compile_step(jax.device_put(state, s.state_sharding), b, compiler_options)[0]
                        for s, b in zip((ref, *progs), placed)]
        mu = _adam_mu(state)
        got = []
        for i, prog in enumerate(progs):
            # Each step donates its state. Copied first: a put onto more devices reuses the source's buffer on the
            # device they share, even with may_alias=False (jax 0.12).
            start = state.replace(fp8=other_fp8[i]) if own_fp8 else state
            got.append(compiled[i + 1](jax.device_put(jax.tree.map(jnp.copy, start), prog.state_sharding),
                                       placed[i + 1]))
            other_fp8[i] = got[-1][0].fp8
        state, want_m = compiled[0](state, placed[0])
        want_grads = _grads(state, mu, beta1)
        for steps, (got_state, got_m) in zip(out, got):
            steps.append(Step(jax.device_get(want_m), jax.device_get(got_m), want_grads,
                              _grads(got_state, mu, beta1), _latest_amax(state), _latest_amax(got_state)))
    return out


def _grads(state, mu_before, beta1) -> dict:
    """param path -> the gradient the step applied, from Adam's first moment before and after it."""
    return {k: (m1 - beta1 * mu_before[k]) / (1 - beta1) for k, m1 in _adam_mu(state).items()}
