"""What a run prints before its first step: the model, mesh, precision, per-device state bytes, and XLA's memory
estimate of the compiled step against what the device's allocator will give."""

import logging
import os

import jax
import jax.numpy as jnp

from mjax.model.functional import count_params
from mjax.parallel.mesh import describe
from mjax.parallel.rules import bytes_per_device

log = logging.getLogger("mjax")


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def precision_summary(precision) -> str:
    parts = [f"compute {precision.compute_dtype}", f"params {precision.params_dtype}"]
    if precision.fp8_recipe:
        parts.append(f"FP8 {precision.fp8_recipe} ({precision.fp8_format})")
    if precision.fp4_recipe:
        extras = [n for n, on in (("hadamard", precision.fp4_hadamard),
                                  ("stochastic rounding", precision.fp4_stochastic_rounding)) if on]
        parts.append(f"FP4 {precision.fp4_recipe}" + (f" ({', '.join(extras)})" if extras else ""))
    if (precision.fp8_recipe or precision.fp4_recipe) and precision.quantize_output_layer:
        parts.append("output layer quantized")
    return ", ".join(parts)


def log_startup(setup, state, flops: float) -> None:
    cfg, m = setup.cfg, setup.cfg.model
    log.info("model %s: %.3fB parameters, %d layers%s, hidden %d, heads %d/%d, vocab %d (padded %d)", m.name,
             count_params(state.params) / 1e9, m.num_layers,
             f" + {m.mtp_depth} multi-token prediction" if m.mtp_depth else "", m.hidden_size,
             m.num_attention_heads, m.num_kv_heads, m.vocab_size, setup.model.vocab_size)
    log.info("mesh %s over %d %s devices; micro-batches per step %d", describe(setup.mesh), setup.mesh.size,
             jax.devices()[0].platform, setup.micro_batches)
    p = cfg.parallel
    if p.cp > 1:
        log.info("context parallelism: each device holds %d of every sequence's %d tokens (load-balanced chunks), "
                 "attention by %s", cfg.train.seq_length // p.cp, cfg.train.seq_length, p.cp_comm_type)
    log.info("precision: %s; %.3f TFLOP per step (Megatron formula)", precision_summary(cfg.precision), flops / 1e12)
    a, s = setup.abstract_state, setup.state_sharding
    params_b = bytes_per_device(a.params, s.params)
    opt_b = bytes_per_device(a.opt_state, s.opt_state)
    grads_b = bytes_per_device(jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), a.params),
                               s.params)  # accumulated in fp32 whatever --params_dtype is (train/step.py)
    log.info("per device: params %s, optimizer state %s, gradients %s (fp32, sharded as params)%s",
             gib(params_b), gib(opt_b), gib(grads_b),
             " [ZeRO-1: optimizer state split over data]" if cfg.parallel.use_distributed_optimizer else "")


def compiled_memory(compiled):
    """XLA's own accounting of a compiled step per device: (memory analysis, arguments + outputs - donated +
    temporaries in bytes), or None where the backend gives none."""
    try:
        m = compiled.memory_analysis()
    except (AttributeError, NotImplementedError, RuntimeError):
        return None
    if m is None:
        return None
    return m, m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


def allocator_limit() -> tuple[int, str] | None:
    """(bytes one device may use, where the figure comes from): the GPU allocator's limit, or on CPU the host's
    physical memory shared by the process's devices; None when unknown."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
        return int(stats["bytes_limit"]), f"the allocator's limit (XLA_PYTHON_CLIENT_MEM_FRACTION={fraction})"
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    return total // jax.local_device_count(), f"host memory / {jax.local_device_count()} local devices"


def log_compiled_memory(compiled) -> None:
    """The memory each device will need for the compiled step, with a warning when it exceeds what it can get."""
    analysis = compiled_memory(compiled)
    if analysis is None:
        return
    m, total = analysis
    log.info("compiled step memory per device: arguments %s, outputs %s (donated %s), temporaries %s -> "
             "expected peak about %s", gib(m.argument_size_in_bytes), gib(m.output_size_in_bytes),
             gib(m.alias_size_in_bytes), gib(m.temp_size_in_bytes), gib(total))
    limit = allocator_limit()
    if limit is not None and total > limit[0]:
        log.warning("the compiled step needs about %s per device, more than the %s of %s: expect an out-of-memory "
                    "error or heavy swapping. Lower --micro_batch_size, use --remat_policy=selective or full, or "
                    "shard more (--fsdp, --tp, --pp)", gib(total), gib(limit[0]), limit[1])
