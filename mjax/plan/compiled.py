"""--validate: the real train step of a layout compiled ahead of time on the devices present, from abstract state and
batch (nothing is materialised), and XLA's memory analysis of it."""

import jax
import jax.numpy as jnp

from mjax.train.loop import build
from mjax.train.startup import compiled_memory

BATCH_FIELDS = ("inputs", "targets", "loss_mask", "positions", "segment_ids")


def compile_layout(cfg, devices=None, compiler_options=None):
    """The compiled train step of `cfg` on `devices` (default: all), as train.py would run it."""
    setup = build(cfg, devices)
    shape = (setup.micro_batches, cfg.train.global_batch_size // setup.micro_batches, cfg.train.seq_length)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "loss_mask" else jnp.int32,
                                     sharding=setup.batch_sharding) for k in BATCH_FIELDS}
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), setup.abstract_state,
                         setup.state_sharding)
    return setup.compile_step(state, batch, compiler_options)[0]


def compiled_bytes(cfg, devices=None, compiler_options=None) -> dict | None:
    """XLA's estimate per device: {"arguments", "outputs", "aliased", "temporaries", "total"}; None where the
    backend gives no memory analysis."""
    analysis = compiled_memory(compile_layout(cfg, devices, compiler_options))
    if analysis is None:
        return None
    m, total = analysis
    return {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
            "aliased": m.alias_size_in_bytes, "temporaries": m.temp_size_in_bytes, "total": total}
