"""A config against a device count: the data-parallel size, the micro-batching, and the checks that need both.

Pure arithmetic (no JAX), so the training script, the mesh and the layout planner share one answer.
`validate_layout(cfg, n)` is the whole validation of a run on n devices (the config's own checks included).
"""

import dataclasses
import logging

from mjax.config.base import ConfigError
from mjax.config.validate import check_blockwise_dims, pipeline_schedule, positive, validate
from mjax.kernels.options import CUDNN_NOT_DETERMINISTIC
from mjax.xla_flags import DETERMINISTIC_FLAGS, deterministic_run

log = logging.getLogger("mjax")


@dataclasses.dataclass(frozen=True)
class Batching:
    """Megatron's batch arithmetic: global_batch_size = micro_batch_size x data-parallel size x micro_batches."""
    shards: int  # data-parallel size: the batch is split over dp x fsdp x ep
    micro_batch_size: int  # per shard
    micro_batches: int  # accumulated (or pipelined) per step
    chosen: bool = False  # micro_batch_size was unset and picked for the pipeline


def resolve_data_parallel(cfg, num_devices: int) -> int:
    """The `dp` mesh-axis size: explicit, or the devices left after the other axes (dp=-1)."""
    p = cfg.parallel
    others = p.tp * p.pp * p.ep * p.cp * p.fsdp
    if p.dp == -1:
        if num_devices % others:
            raise ConfigError(
                f"{num_devices} devices cannot be split into tp={p.tp} x pp={p.pp} x ep={p.ep} x cp={p.cp} x "
                f"fsdp={p.fsdp} (product {others}); change those flags so their product divides {num_devices}")
        return num_devices // others
    if others * p.dp != num_devices:
        raise ConfigError(
            f"the mesh tp={p.tp} x pp={p.pp} x ep={p.ep} x cp={p.cp} x fsdp={p.fsdp} x dp={p.dp} = "
            f"{others * p.dp} devices, but {num_devices} are present; set --dp=-1 to fill them")
    return p.dp


def resolve_batch(cfg, num_devices: int) -> Batching:
    """The micro-batching of a step. With --pp > 1 and --micro_batch_size unset, the largest micro-batch that still
    gives every pipeline stage work (at least --pp micro-batches) is chosen; without a pipeline, no accumulation."""
    t, p = cfg.train, cfg.parallel
    shards = resolve_data_parallel(cfg, num_devices) * p.fsdp * p.ep
    if t.global_batch_size % shards:
        raise ConfigError(
            f"--global_batch_size={t.global_batch_size} is not divisible by the data-parallel size {shards} "
            f"(dp x fsdp x ep)")
    per_shard = t.global_batch_size // shards
    micro, chosen = t.micro_batch_size, False
    if micro is None:
        micro = per_shard
        if p.pp > 1:
            fits = [m for m in range(per_shard, 0, -1) if per_shard % m == 0 and per_shard // m >= p.pp]
            micro, chosen = (fits[0], True) if fits else (per_shard, False)
    positive(micro, "micro_batch_size")
    if per_shard % micro:
        raise ConfigError(
            f"--global_batch_size={t.global_batch_size} is not divisible by data-parallel size {shards} "
            f"x --micro_batch_size={micro}")
    return Batching(shards, micro, per_shard // micro, chosen)


def check_attention_device(execution) -> None:
    """An --attention_impl that names a GPU kernel needs that GPU, and cuDNN's a run without deterministic ops
    (--deterministic_mode or XLA_FLAGS; the per-call rules are the dispatch's)."""
    impl = execution.attention_impl
    if impl not in ("cudnn", "mosaic"):
        return
    if impl == "cudnn" and deterministic_run(execution):
        source = ("--deterministic_mode" if execution.deterministic_mode
                  else f"deterministic ops in XLA_FLAGS ({' or '.join(DETERMINISTIC_FLAGS)})")
        raise ConfigError(f"--attention_impl=cudnn with {source}: {CUDNN_NOT_DETERMINISTIC}; use "
                          "--attention_impl=auto (which then skips cuDNN), mosaic or pallas")
    import jax  # noqa: PLC0415  (validating a config of other choices loads no JAX)

    from mjax.kernels.device import is_hopper  # noqa: PLC0415

    backend = jax.default_backend()
    if impl == "cudnn" and backend != "gpu":
        raise ConfigError(f"--attention_impl=cudnn needs a GPU (the backend is {backend}); use --attention_impl=auto")
    if impl == "mosaic" and not is_hopper():
        raise ConfigError(f"--attention_impl=mosaic needs a Hopper GPU (compute capability 9.0), not "
                          f"{jax.devices()[0].device_kind}; use --attention_impl=auto or pallas")


def validate_layout(cfg, num_devices: int) -> Batching:
    """Every check of a run on `num_devices` devices, before anything is traced; returns its batching."""
    validate(cfg)
    check_attention_device(cfg.execution)
    resolve_data_parallel(cfg, num_devices)
    batching = resolve_batch(cfg, num_devices)
    p = cfg.parallel
    if batching.micro_batches < p.pp:
        raise ConfigError(
            f"{batching.micro_batches} micro-batch(es) per step (--global_batch_size={cfg.train.global_batch_size} / "
            f"(data-parallel size {batching.shards} x --micro_batch_size={batching.micro_batch_size})) are fewer than "
            f"the --pp={p.pp} pipeline stages, so stages would idle; lower --micro_batch_size or raise "
            f"--global_batch_size to get at least {p.pp}")
    if p.pp > 1 and pipeline_schedule(p) == "interleaved_1f1b" and batching.micro_batches % p.pp:
        raise ConfigError(
            f"--pipeline_schedule=interleaved_1f1b runs the micro-batches in groups of --pp={p.pp} (as Megatron), "
            f"but the step has {batching.micro_batches}; change --global_batch_size or --micro_batch_size")
    if cfg.precision.fp8_recipe == "blockwise":
        check_blockwise_dims({"--micro_batch_size x --seq_length (tokens per micro-batch)":
                              batching.micro_batch_size * cfg.train.seq_length})
    return batching


def describe_batching(cfg, batching: Batching) -> str:
    """The start-up line of the batch arithmetic (says when the micro-batch was picked for the pipeline)."""
    how = (f" (--micro_batch_size unset: {batching.micro_batch_size} gives the --pp={cfg.parallel.pp} stages "
           f"{batching.micro_batches} micro-batches)" if batching.chosen else "")
    return (f"global batch {cfg.train.global_batch_size} = micro-batch {batching.micro_batch_size} x data-parallel "
            f"{batching.shards} x {batching.micro_batches} micro-batches{how}")
