"""FP8 scaling state in the train state: per linear layer an amax history and the scales derived from it.

The model's FP8 layers take their scales as an input whose "gradient" is the amax they observed this step
(mjax/kernels/quant/fp8.py), so `jax.grad` returns the new amaxes next to the parameter gradients: stacked [L, 3] for the
scanned layers, max-reduced over micro-batches by the step. `update` then rolls them into the history and
derives the next scales, Transformer Engine's delayed scaling:

    history[0] = amax;   scale = fp8_max / (amax_ref * 2^margin),  amax_ref = history[0] | max(history)

A zero or non-finite amax_ref keeps the previous scale, and a non-finite amax is recorded as 0, so one bad step
cannot poison later scales. Current-scaling recipes keep the same state (history length as configured) for
statistics only. The state is a pytree inside TrainState, so checkpoints save and restore it with everything else.
"""

import jax
import jax.numpy as jnp
from flax import struct

from mjax.kernels.quant.fp8 import FORMATS, fp8_max, pow2_floor


@struct.dataclass
class Fp8State:
    scales: dict  # per FP8 layer [..., 3] f32: (input, weight, grad) scales the next step quantizes with
    amax_history: dict  # per FP8 layer [..., H, 3] f32, most recent first

    @classmethod
    def create(cls, scales: dict, history_len: int) -> "Fp8State":
        history = jax.tree.map(lambda s: jnp.zeros(s.shape[:-1] + (history_len, s.shape[-1]), jnp.float32), scales)
        return cls(scales=jax.tree.map(lambda s: jnp.asarray(s, jnp.float32), scales), amax_history=history)


def _maxima(precision) -> jax.Array:
    fwd, grad = FORMATS[precision.fp8_format]
    return jnp.array([fp8_max(fwd), fp8_max(fwd), fp8_max(grad)], jnp.float32)  # rows (input, weight, grad)


def update(state: Fp8State, observed: dict, precision) -> tuple[Fp8State, dict]:
    """Folds this step's observed amaxes (the scales' "gradients") in; returns the new state and statistics."""
    maxima = _maxima(precision)
    margin = 2.0 ** precision.fp8_margin

    def one(history, scale, amax):
        finite = jnp.isfinite(amax)
        history = jnp.roll(history, 1, axis=-2).at[..., 0, :].set(jnp.where(finite, amax, 0.0))
        ref = history[..., 0, :] if precision.fp8_amax_compute_algo == "most_recent" else history.max(axis=-2)
        ok = (ref > 0) & jnp.isfinite(ref)
        new_scale = jnp.where(ok, maxima / (jnp.where(ok, ref, 1.0) * margin), scale)
        return history, new_scale

    pairs = jax.tree.map(one, state.amax_history, state.scales, observed)
    is_pair = lambda x: isinstance(x, tuple)  # noqa: E731
    history = jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair)
    scales = jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair)
    delayed = precision.fp8_recipe == "delayed"
    return Fp8State(scales=scales, amax_history=history), statistics(state.scales, observed, maxima, delayed)


def statistics(scales: dict, observed: dict, maxima, delayed: bool) -> dict:
    """Scalars for the step's metrics: saturated tensors (amax x scale used > fp8 max; the GEMMs use each scale
    rounded down to a power of two; only delayed scaling can overflow, current scaling reports 0), non-finite
    amaxes, and the range of amaxes and scales."""
    amaxes, used = jax.tree.leaves(observed), [pow2_floor(s) for s in jax.tree.leaves(scales)]
    if not amaxes:
        return {}
    overflow = sum(jnp.sum(a * s > maxima) for a, s in zip(amaxes, used)) if delayed else jnp.zeros((), jnp.int32)
    nonfinite = sum(jnp.sum(~jnp.isfinite(a)) for a in amaxes)
    finite_max = [jnp.max(jnp.where(jnp.isfinite(a), a, 0.0)) for a in amaxes]
    return {"fp8_overflow": overflow.astype(jnp.int32), "fp8_nonfinite_amax": nonfinite.astype(jnp.int32),
            "fp8_amax_max": jnp.max(jnp.stack(finite_max)),
            "fp8_scale_min": jnp.min(jnp.stack([jnp.min(s) for s in used])),
            "fp8_scale_max": jnp.max(jnp.stack([jnp.max(s) for s in used]))}
