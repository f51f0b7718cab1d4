"""Typed run configuration: model, parallel layout, precision, optimizer, training, data, checkpoint, logging.

A `Config` is plain frozen data. `Config.validate()` raises `ConfigError` in plain words for every mistake that can
be found from the config alone, before anything is traced (mjax.parallel.layout checks it against the devices).
"""

import dataclasses
from typing import Any

from mjax.config.base import ConfigError, field
from mjax.config.execution import ExecutionConfig
from mjax.config.model import ModelConfig


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tp: int = field(1, "tp", "Tensor-parallel size.")
    pp: int = field(1, "pp", "Pipeline-parallel size.")
    vpp: int = field(1, "vpp", "Virtual pipeline stages per device (Megatron's interleaved schedule).")
    pipeline_schedule: str | None = field(
        None, "pipeline_schedule", "gpipe | 1f1b | zero_bubble (ZB-H1, --vpp=1) | interleaved_1f1b | interleaved (both "
        "need --vpp > 1); unset: interleaved_1f1b when --vpp > 1, else 1f1b (docs/parallelism.md).")
    decoder_first_pipeline_num_layers: int | None = field(
        None, "decoder_first_pipeline_num_layers", "Transformer layers of the first pipeline stage (Megatron's uneven "
        "split); the other stages split the rest evenly.")
    decoder_last_pipeline_num_layers: int | None = field(
        None, "decoder_last_pipeline_num_layers", "Transformer layers of the last pipeline stage (Megatron's uneven "
        "split).")
    account_for_embedding_in_pipeline_split: bool = field(
        False, "account_for_embedding_in_pipeline_split", "Count the embedding as one layer of the pipeline split: "
        "the first stage holds one transformer layer less.")
    account_for_loss_in_pipeline_split: bool = field(
        False, "account_for_loss_in_pipeline_split", "Count the loss as one layer of the pipeline split: the last "
        "stage holds one transformer layer less.")
    pipeline_model_parallel_layout: str | None = field(
        None, "pipeline_model_parallel_layout", "Megatron's layout string, e.g. \"Ett|(tt|)*2tL\": | ends a (virtual) "
        "stage, E embedding, t transformer layer, L loss, (...)*n repeats (docs/parallelism.md).")
    ep: int = field(1, "ep", "Expert-parallel size.")
    expert_tensor_parallel_size: int | None = field(
        None, "expert_tensor_parallel_size", "Tensor-parallel size of the experts: --tp (unset) or 1 (the experts "
        "are then split over --ep x --tp devices; MoE parallel folding).")
    moe_token_dispatcher_type: str = field(
        "alltoall", "moe_token_dispatcher_type", "alltoall | allgather: how tokens reach experts on other --ep ranks.")
    cp: int = field(1, "cp", "Context-parallel size: every sequence split over --cp devices, attention across them.")
    cp_comm_type: str = field(
        "p2p", "cp_comm_type", "p2p (ring) | all_gather | a2a (Ulysses) | a2a+p2p: how context-parallel attention "
        "communicates (docs/parallelism.md).")
    hierarchical_context_parallel_sizes: tuple[int, ...] | None = field(
        None, "hierarchical_context_parallel_sizes", "a2a+p2p: [all-to-all group size, ring size], their product "
        "--cp (e.g. 2,4).")
    fsdp: int = field(1, "fsdp", "Fully-sharded data-parallel size.")
    dp: int = field(-1, "dp", "Data-parallel size; -1 fills the remaining devices.")
    sequence_parallel: bool = field(False, "sequence_parallel")
    use_distributed_optimizer: bool = field(False, "use_distributed_optimizer", "ZeRO-1.")
    coordinator_address: str | None = field(None, "coordinator_address", "host:port of process 0 (multi-host).")
    num_processes: int | None = field(None, "num_processes")
    process_id: int | None = field(None, "process_id")
    distributed_timeout_s: int = field(300, "distributed_timeout_s",
                                       "Seconds to wait for every process to connect at start-up.")


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    compute_dtype: str = field("bfloat16", help="bfloat16 | float16 | float32 (--bf16/--fp16 set it).")
    params_dtype: str = field("float32", help="Master parameter dtype.")
    loss_scale: float | None = field(None, "loss_scale", "Static fp16 loss scale; None means dynamic.")
    initial_loss_scale: float = field(2.0**32, "initial_loss_scale")
    min_loss_scale: float = field(1.0, "min_loss_scale")
    loss_scale_window: int = field(1000, "loss_scale_window")
    hysteresis: int = field(2, "hysteresis")
    # FP8 / FP4 linear layers (mjax/kernels/quant/). Unset recipes train every GEMM in compute_dtype.
    fp8_recipe: str | None = field(
        None, "fp8_recipe", "delayed | tensorwise | blockwise: FP8 GEMMs scaled from an amax history, from this "
        "step's amax, or per 1x128 / 128x128 block.")
    fp8_format: str = field("hybrid", "fp8_format", "e4m3 (every GEMM operand) | hybrid (e4m3 forward, e5m2 grads).")
    fp8_amax_history_len: int = field(1, "fp8_amax_history_len", "Steps of amax history (delayed scaling).")
    fp8_amax_compute_algo: str = field("most_recent", "fp8_amax_compute_algo",
                                        "most_recent | max: the amax a delayed scale is computed from.")
    fp8_margin: int = field(0, "fp8_margin", "Scales are divided by 2^margin (headroom against overflow).")
    fp8_log_stats: bool = field(False, "fp8_log_stats", "Log FP8 amax/scale statistics at each logged step.")
    fp8_keep_casts: bool = field(
        True, "fp8_keep_casts", "With --remat_policy=selective and per-tensor FP8, keep each GEMM's FP8 operands for "
        "its backward (remat name fp8_cast; on by default) instead of recomputing them.")
    fp4_recipe: str | None = field(
        None, "fp4_recipe", "nvfp4 | mxfp4: e2m1 GEMM inputs with 16-element e4m3 or 32-element e8m0 block scales, "
        "emulated on Hopper.")
    fp4_hadamard: bool = field(False, "fp4_hadamard", "Random Hadamard transform on the FP4 wgrad inputs.")
    fp4_stochastic_rounding: bool = field(
        False, "fp4_stochastic_rounding", "Round the output gradient's FP4 copies stochastically, not to nearest.")
    first_last_layers_bf16: bool = field(
        False, "first_last_layers_bf16", "Keep the first/last transformer layers of an FP8/FP4 run in compute_dtype.")
    num_layers_at_start_in_bf16: int = field(1, "num_layers_at_start_in_bf16")
    num_layers_at_end_in_bf16: int = field(1, "num_layers_at_end_in_bf16")
    quantize_output_layer: bool = field(
        False, "quantize_output_layer", "Quantize the output layer (LM head or tied embedding) too; by default it "
        "stays in compute_dtype.")
    quant_impl: str = field("auto", "quant_impl", "auto | xla | pallas: the quantization kernels (auto: pallas on a "
                             "GPU, the pure-JAX reference elsewhere).")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    optimizer: str = field("adamw", "optimizer", "adamw | sgd")
    lr: float = field(3e-4, "lr")
    min_lr: float = field(0.0, "min_lr")
    lr_decay_style: str = field("cosine", "lr_decay_style", "constant | linear | cosine | wsd")
    lr_warmup_iters: int = field(0, "lr_warmup_iters")
    lr_decay_iters: int | None = field(None, "lr_decay_iters", "None means train_iters.")
    lr_wsd_decay_iters: int | None = field(None, "lr_wsd_decay_iters", "WSD: length of the final decay.")
    lr_wsd_decay_style: str = field("linear", "lr_wsd_decay_style", "linear | cosine | minus_sqrt")
    weight_decay: float = field(0.1, "weight_decay")
    adam_beta1: float = field(0.9, "adam_beta1")
    adam_beta2: float = field(0.95, "adam_beta2")
    adam_eps: float = field(1e-8, "adam_eps")
    clip_grad: float = field(1.0, "clip_grad", "Global-norm clip; 0 disables.")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    train_iters: int = field(100, "train_iters")
    global_batch_size: int = field(8, "global_batch_size")
    micro_batch_size: int | None = field(None, "micro_batch_size", "None means no accumulation.")
    seq_length: int = field(128, "seq_length")
    seed: int = field(1234, "seed")
    z_loss_coeff: float = field(0.0, "z_loss_coeff", "Weight of log(Z)^2 in the loss (PaLM z-loss).")
    on_nonfinite: str = field("stop", "on_nonfinite", "stop | skip: a NaN/Inf loss or grad norm.")
    eval_interval: int = field(0, "eval_interval", "0 disables evaluation.")
    eval_iters: int = field(10, "eval_iters")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    mock_data: bool = field(False, "mock_data", "Synthetic random tokens.")
    data_path: tuple[str, ...] = field((), "data_path", "Prefixes of .bin/.idx datasets, optionally weighted.")
    split: str = field("969,30,1", "split")
    tokenizer_type: str = field("sample", "tokenizer_type", "sample | huggingface | tiktoken")
    tokenizer_model: str | None = field(None, "tokenizer_model")
    eod_mask_loss: bool = field(False, "eod_mask_loss")
    reset_position_ids: bool = field(False, "reset_position_ids")
    reset_attention_mask: bool = field(False, "reset_attention_mask", "Segment ids at document boundaries.")
    balance_attention_work: bool = field(
        True, "balance_attention_work", "With --reset_attention_mask: order the documents of each row and the rows "
        "of each batch so that every context- and data-parallel rank has the same attention work (the loss is "
        "unchanged; dense models only); attention_imbalance is logged either way.")
    data_cache_path: str | None = field(None, "data_cache_path")
    prefetch: int = field(2, help="Batches prepared ahead in a background thread.")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = field(None, "save")
    load: str | None = field(None, "load")
    ckpt_step: int | None = field(None, "ckpt_step", "The step to read from --load (default: its latest).")
    save_interval: int = field(0, "save_interval")
    keep: int | None = field(None, "keep")
    async_save: bool = field(True, "async_save")
    load_params_only: bool = field(False, "load_params_only", "Weights only: fresh optimizer and step.")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = field(10, "log_interval")
    metrics_file: str | None = field(None, "metrics_file", "JSON lines, one per logged step.")
    tensorboard_dir: str | None = field(None, "tensorboard_dir")
    progress: bool = field(True, "progress", "A progress bar on a terminal.")
    peak_tflops: float | None = field(None, "peak_tflops", "MFU denominator; None means the device's.")


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    execution: ExecutionConfig = dataclasses.field(default_factory=ExecutionConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)

    def replace(self, **sections: dict[str, Any]) -> "Config":
        """`cfg.replace(model={"num_layers": 4})` returns a copy with those fields changed."""
        new = {}
        for section, fields in sections.items():
            if section not in SECTIONS:
                raise ConfigError(f"unknown config section {section!r}; known: {', '.join(SECTIONS)}")
            current = getattr(self, section)
            names = {f.name for f in dataclasses.fields(current)}
            for k in fields:
                if k not in names:
                    raise ConfigError(f"unknown field {section}.{k}")
            new[section] = dataclasses.replace(current, **fields)
        return dataclasses.replace(self, **new)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> "Config":
        """The checks that need only the config; `mjax.parallel.layout.validate_layout` adds the devices'."""
        from mjax.config.validate import validate  # noqa: PLC0415  (validate imports this module)

        validate(self)
        return self


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


# Fields a saved config (a checkpoint's, a converted config.json) may hold under an earlier name or section.
RENAMED = {("model", name): ("execution", name) for name in (
    "attention_impl", "qkv_grad_impl", "cross_entropy_impl", "cross_entropy_chunk", "moe_grouped_gemm_impl",
    "remat_policy", "remat_save_names", "scan_layers")} | {
    ("model", "sliding_window"): ("model", "window_size"), ("checkpoint", "load_step"): ("checkpoint", "ckpt_step")}


def current_names(d: dict) -> dict:
    """A saved config dict with each field under today's section and name (RENAMED); lists become tuples. A field
    given under both its earlier and its current name is an error."""
    out, source = {}, {}
    for section, fields in d.items():
        if not isinstance(fields, dict):
            out[section] = fields
            continue
        for k, v in fields.items():
            target, name = RENAMED.get((section, k), (section, k))
            if (target, name) in source:
                earlier = sorted((source[target, name], f"{section}.{k}"), key=lambda n: n == f"{target}.{name}")
                raise ConfigError(f"the config holds both {earlier[0]} and {earlier[1]}, one field under its "
                                  f"earlier and its current name; keep only {target}.{name}")
            source[target, name] = f"{section}.{k}"
            out.setdefault(target, {})[name] = tuple(v) if isinstance(v, list) else v
    return out


def from_dict(d: dict) -> Config:
    """Inverse of `Config.to_dict`; lists become tuples; unknown keys are errors; fields saved under an earlier
    name are read under today's (RENAMED)."""
    unknown = [section for section in d if section not in SECTIONS]
    if unknown:
        raise ConfigError(f"unknown config section {unknown[0]!r}")
    return Config().replace(**current_names(d))
