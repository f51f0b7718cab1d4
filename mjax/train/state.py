"""The train state: one pytree holding everything a step reads and writes (and a checkpoint saves)."""

import jax
import jax.numpy as jnp
from flax import struct

from mjax.train.fp8_state import Fp8State


@struct.dataclass
class LossScale:
    """Megatron-style dynamic loss scaling for fp16 (a static scale never changes)."""
    scale: jax.Array
    good_steps: jax.Array
    hysteresis_left: jax.Array

    @classmethod
    def create(cls, precision):
        initial = precision.loss_scale or precision.initial_loss_scale
        return cls(jnp.asarray(initial, jnp.float32), jnp.zeros((), jnp.int32),
                   jnp.asarray(precision.hysteresis, jnp.int32))

    def update(self, finite, precision, dynamic: bool) -> "LossScale":
        if not dynamic:
            return self
        hysteresis = jnp.where(finite, self.hysteresis_left, self.hysteresis_left - 1)
        shrink = ~finite & (hysteresis <= 0)
        good = jnp.where(finite, self.good_steps + 1, 0)
        grow = good >= precision.loss_scale_window
        scale = jnp.where(shrink, jnp.maximum(self.scale / 2, precision.min_loss_scale), self.scale)
        scale = jnp.where(grow, scale * 2, scale)
        hysteresis = jnp.where(grow | shrink, precision.hysteresis, hysteresis)
        return LossScale(scale, jnp.where(grow, 0, good), hysteresis.astype(jnp.int32))


@struct.dataclass
class TrainState:
    step: jax.Array  # int32: optimizer steps taken
    params: dict
    opt_state: object
    rng: jax.Array
    loss_scale: LossScale
    first_nonfinite_step: jax.Array  # int32, -1 until a step's loss or grad norm is NaN/Inf
    skipped_steps: jax.Array  # int32: updates not applied (non-finite or fp16 overflow)
    fp8: Fp8State | None = None  # FP8 amax history and scales (--fp8_recipe), else None

    @classmethod
    def create(cls, params, tx, rng, precision, fp8_scales: dict | None = None):
        """fp8_scales: the model's initial FP8 scales (ModelDef.init_fp8()); empty or None without FP8."""
        fp8 = Fp8State.create(fp8_scales, precision.fp8_amax_history_len) if fp8_scales else None
        return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=rng,
                   loss_scale=LossScale.create(precision), first_nonfinite_step=jnp.full((), -1, jnp.int32),
                   skipped_steps=jnp.zeros((), jnp.int32), fp8=fp8)
