"""Small synthetic data for training tests: a learnable pattern (each odd token repeats the one before); the initial
train state and the train step of a config, built the way the training loop builds them, for less compile time."""

import jax
import numpy as np

from mjax.config import load_config
from mjax.train.loop import build

# Three times faster XLA:CPU compiles of a train step (LLVM work only: the same HLO and buffer assignment). The
# results move at the last bit, as another summation order moves them: compare programs compiled alike.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


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


def document_batches(cfg, seed=0, mean_length=50):
    """pattern_batches' tokens packed as documents (reset positions and segment ids; ~`mean_length` tokens each,
    boundaries anywhere, including across context-parallel chunks)."""
    rng = np.random.default_rng(seed)
    b, t = cfg.train.global_batch_size, cfg.train.seq_length
    index = np.arange(t)
    for batch in pattern_batches(cfg, seed):
        seg = np.cumsum(rng.random((b, t)) < 1 / mean_length, axis=1).astype(np.int32)  # [B, T]
        start = np.where(np.diff(seg, axis=1, prepend=-1) != 0, index, 0)
        yield {**batch, "positions": (index - np.maximum.accumulate(start, axis=1)).astype(np.int32),
               "segment_ids": seg}


_initial_params = {}


def initial_state(setup, seed=None):
    """setup.init_state(seed) (default: the config's seed), compiled like the tests' steps (FAST_COMPILE), its params
    initialised once per model and seed in this process: compiling the init costs more than a tiny train step. The
    params depend on the model config and the layer stack (scanned or not) only, not on the layout (partitionable
    RNG), the precision (quantization adds no parameters) or the kernels; the rest of the state is built fresh, with
    the setup's optimizer."""
    cfg = setup.cfg
    seed = cfg.train.seed if seed is None else seed
    abstract = setup.abstract_state.params
    key = (cfg.model, cfg.execution.scan_layers, seed, jax.tree.structure(abstract),
           tuple((a.shape, a.dtype) for a in jax.tree.leaves(abstract)))
    if key not in _initial_params:
        state = setup.init_state(seed, FAST_COMPILE)
        _initial_params[key] = jax.tree.map(np.array, state.params)  # host copies, apart from donated buffers
        return state
    _, rng = jax.random.split(jax.random.key(seed))  # as Setup.init_state splits it
    # A copy each time: a device_put of host memory may alias it on CPU, and train steps donate their state.
    params = jax.tree.map(np.copy, _initial_params[key])
    return jax.device_put(setup.state_from_params(params, rng), setup.state_sharding)


def run_steps(cfg, devices=None, compiler_options=FAST_COMPILE, batches=pattern_batches):
    """(metrics of each step on the host, final state): cfg.train.train_iters steps of the training loop's compiled
    step (Setup.compile_step) on batches(cfg) (pattern_batches), from initial_state."""
    setup = build(cfg, devices)
    state, data, history = initial_state(setup), batches(cfg), []
    batch = setup.place_batch(next(data))
    step, _ = setup.compile_step(state, batch, compiler_options)
    for _ in range(cfg.train.train_iters):
        state, metrics = step(state, batch)
        history.append(jax.device_get(metrics))
        batch = setup.place_batch(next(data))
    return history, state


def multiprocess_config():
    """The layout of the two-process test: tp=2 x dp=4 over 2 processes x 4 devices."""
    return tiny_config(parallel=dict(tp=2), train=dict(train_iters=3))
