"""Learning-rate schedules (Megatron's warmup + constant/linear/cosine/WSD decay) and the optax optimizer."""

import math

import jax
import jax.numpy as jnp
import optax

DECAYED_LEAVES = ("kernel", "embedding", "pos_embed")  # biases and norm scales get no weight decay (as Megatron)


def lr_schedule(opt_cfg, train_iters: int):
    """step -> learning rate. Linear warmup from 0, then decay to min_lr by `lr_decay_iters` (default train_iters)."""
    lr, min_lr, warmup = opt_cfg.lr, opt_cfg.min_lr, opt_cfg.lr_warmup_iters
    decay_iters = opt_cfg.lr_decay_iters or train_iters
    style = opt_cfg.lr_decay_style

    def shape(progress, kind):  # progress in [0, 1] -> multiplier in [0, 1] of (lr - min_lr)
        if kind == "linear":
            return 1.0 - progress
        if kind == "cosine":
            return 0.5 * (1.0 + jnp.cos(math.pi * progress))
        if kind == "minus_sqrt":
            return 1.0 - jnp.sqrt(progress)
        return 1.0

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = lr * step / max(warmup, 1)
        if style == "constant":
            decayed = jnp.asarray(lr, jnp.float32)
        elif style == "wsd":
            start = decay_iters - opt_cfg.lr_wsd_decay_iters
            progress = jnp.clip((step - start) / opt_cfg.lr_wsd_decay_iters, 0.0, 1.0)
            decayed = min_lr + (lr - min_lr) * shape(progress, opt_cfg.lr_wsd_decay_style)
        else:
            progress = jnp.clip((step - warmup) / max(decay_iters - warmup, 1), 0.0, 1.0)
            decayed = min_lr + (lr - min_lr) * shape(progress, style)
        return jnp.where(step < warmup, warm, decayed)

    return schedule


def decay_mask(params):
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in DECAYED_LEAVES, params)


def make_optimizer(opt_cfg, schedule) -> optax.GradientTransformation:
    """AdamW (or SGD) with the schedule (`lr_schedule`); gradient clipping is done by the step, which also reports
    the norm."""
    if opt_cfg.optimizer == "sgd":
        return optax.chain(optax.add_decayed_weights(opt_cfg.weight_decay, decay_mask), optax.sgd(schedule))
    return optax.adamw(schedule, b1=opt_cfg.adam_beta1, b2=opt_cfg.adam_beta2, eps=opt_cfg.adam_eps,
                       weight_decay=opt_cfg.weight_decay, mask=decay_mask)
