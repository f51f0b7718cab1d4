"""Small synthetic data for training tests: a learnable pattern (each odd token repeats the one before)."""

import numpy as np

from mjax.config import load_config


def tiny_config(**sections):
    base = load_config("tiny").replace(
        model=dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                   vocab_size=128),
        train=dict(train_iters=4, global_batch_size=16, seq_length=32, eval_interval=0),
        optimizer=dict(lr=1e-2, lr_warmup_iters=0, lr_decay_style="constant", min_lr=0.0),
        logging=dict(log_interval=1, progress=False))
    return base.replace(**sections)


def pattern_batches(cfg, seed=0, nan_mask_at=None):
    """Yields global batches forever; batch number `nan_mask_at` (0-based) carries a NaN in its loss mask."""
    rng = np.random.default_rng(seed)
    b, t = cfg.train.global_batch_size, cfg.train.seq_length
    i = 0
    while True:
        x = rng.integers(1, cfg.model.vocab_size, (b, t + 1)).astype(np.int32)
        x[:, 1::2] = x[:, 0:-1:2]
        mask = np.ones((b, t), np.float32)
        if i == nan_mask_at:
            mask[0, 0] = np.nan
        yield {"inputs": x[:, :-1], "targets": x[:, 1:], "loss_mask": mask,
               "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
               "segment_ids": np.ones((b, t), np.int32)}
        i += 1


def multiprocess_config():
    """The layout of the two-process test: tp=2 x dp=4 over 2 processes x 4 devices."""
    return tiny_config(parallel=dict(tp=2), train=dict(train_iters=3))
