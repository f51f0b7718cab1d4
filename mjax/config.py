"""Typed run configuration: model, parallel layout, precision, optimizer, training, data, checkpoint, logging.

A `Config` is plain frozen data. `Config.validate()` raises `ConfigError` in plain words for every mistake that can
be found from sizes alone, before anything is traced. Presets live in `configs/` (see `load_config`).
"""

import dataclasses
import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration mistake; the message names the flag to change."""


def _field(default, flag: str | None = None, help: str = ""):
    """A config field; `flag` is a short Megatron-style alias of its dotted flag name."""
    meta = {"help": help}
    if flag:
        meta["flag"] = flag
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str = _field("custom", help="Preset name, for logs.")
    num_layers: int = _field(2, "num_layers")
    hidden_size: int = _field(64, "hidden_size")
    num_attention_heads: int = _field(4, "num_attention_heads")
    num_query_groups: int | None = _field(None, "num_query_groups", "KV heads (GQA/MQA); None means MHA.")
    kv_channels: int | None = _field(None, "kv_channels", "Head dim; None means hidden_size / heads.")
    ffn_hidden_size: int = _field(256, "ffn_hidden_size")
    vocab_size: int = _field(256, "vocab_size", "Tokenizer vocab; padded up for sharding.")
    make_vocab_size_divisible_by: int = _field(128, "make_vocab_size_divisible_by")
    max_position_embeddings: int = _field(2048, "max_position_embeddings")
    normalization: str = _field("rmsnorm", "normalization", "rmsnorm | layernorm")
    norm_epsilon: float = _field(1e-5, "norm_epsilon")
    activation: str = _field("swiglu", "activation", "swiglu | gelu")
    position_embedding_type: str = _field("rope", "position_embedding_type", "rope | learned")
    rotary_base: float = _field(10000.0, "rotary_base")
    rope_scaling: str = _field("none", "rope_scaling", "none | llama3")
    rope_scaling_factor: float = _field(8.0, "rope_scaling_factor")
    rope_low_freq_factor: float = _field(1.0)
    rope_high_freq_factor: float = _field(4.0)
    rope_original_max_positions: int = _field(8192)
    add_bias_linear: bool = _field(False, "add_bias_linear", "Biases on every linear layer (GPT-2).")
    add_qkv_bias: bool = _field(False, "add_qkv_bias", "Biases on Q, K, V only (Qwen2).")
    untie_embeddings_and_output_weights: bool = _field(True, "untie_embeddings_and_output_weights")
    sliding_window: int | None = _field(None, "window_size", "Sliding-window attention span (Mistral).")
    init_method_std: float = _field(0.02, "init_method_std")
    attention_impl: str = _field("auto", "attention_impl", "auto | xla | cudnn | pallas")
    qkv_grad_impl: str = _field(
        "auto", "qkv_grad_impl", "auto | xla | pallas: how the backward assembles the fused QKV projection's "
        "gradient from dQ, dK (rotated back) and dV: autodiff's concatenate, or one Pallas pass (kernels/"
        "qkv_rope_grad.py; RoPE models with the fused projection). auto: pallas on a GPU when Triton can tile the "
        "head dim, else xla.")
    cross_entropy_impl: str = _field(
        "reference", "cross_entropy_impl",
        "reference (whole fp32 logits) | fused (output layer + loss in sequence chunks; no whole logits)")
    cross_entropy_chunk: int = _field(1024, "cross_entropy_chunk", "Sequence positions per chunk when fused.")
    remat_policy: str = _field("none", "remat_policy", "none | selective | full")
    # Default: every matmul output and the attention kernel's results are kept, only elementwise work (norms,
    # RoPE, SwiGLU product) is recomputed: the fastest selective set measured on an H200 (docs/performance.md).
    remat_save_names: tuple[str, ...] = _field(
        ("qkv_proj", "attn_core", "attn_context", "attn_out", "mlp_up", "mlp_out"),
        help="With remat_policy=selective: named activations kept; everything else is recomputed.")
    scan_layers: bool = _field(True, help="Run the layer stack with lax.scan (one compiled layer).")
    # Mixture of experts (Megatron's --moe-* names). num_experts=None: every layer has a dense MLP.
    num_experts: int | None = _field(None, "num_experts", "Routed experts per MoE layer; None means a dense model.")
    moe_layer_freq: str = _field(
        "1", "moe_layer_freq", "Which layers are MoE: an int N (every N-th layer from layer 0) or a 0/1 pattern, "
        "e.g. '[0]*1+[1]*27'.")
    moe_first_dense_layers: int = _field(0, "moe_first_dense_layers",
                                         "Leading dense layers before the MoE layers (DeepSeek's first_k_dense).")
    moe_ffn_hidden_size: int | None = _field(None, "moe_ffn_hidden_size", "Expert FFN size; None means ffn_hidden_size.")
    moe_shared_expert_intermediate_size: int | None = _field(
        None, "moe_shared_expert_intermediate_size", "FFN size of the shared experts (all of them together).")
    moe_shared_expert_gate: bool = _field(False, "moe_shared_expert_gate",
                                          "Scale the shared experts' output by sigmoid(x @ w) (Qwen2-MoE).")
    moe_router_topk: int = _field(2, "moe_router_topk")
    moe_router_score_function: str = _field("softmax", "moe_router_score_function", "softmax | sigmoid")
    moe_router_pre_softmax: bool = _field(
        False, "moe_router_pre_softmax", "Softmax over all experts before the top-k (no renormalisation); else the "
        "top-k logits are softmaxed.")
    moe_router_num_groups: int | None = _field(None, "moe_router_num_groups", "Expert groups (group-limited routing).")
    moe_router_group_topk: int | None = _field(None, "moe_router_group_topk", "Groups a token may route to.")
    moe_router_topk_scaling_factor: float | None = _field(None, "moe_router_topk_scaling_factor",
                                                          "Multiplies the routing weights (DeepSeek).")
    moe_router_dtype: str = _field("fp32", "moe_router_dtype", "fp32 | fp64: router logits and scores.")
    moe_router_load_balancing_type: str = _field(
        "aux_loss", "moe_router_load_balancing_type", "aux_loss | seq_aux_loss | global_aux_loss | none")
    moe_aux_loss_coeff: float = _field(0.0, "moe_aux_loss_coeff")
    moe_z_loss_coeff: float = _field(0.0, "moe_z_loss_coeff")
    moe_router_enable_expert_bias: bool = _field(
        False, "moe_router_enable_expert_bias", "Aux-loss-free balancing: a per-expert bias added to the scores for "
        "the top-k choice only, updated every step towards equal load.")
    moe_router_bias_update_rate: float = _field(1e-3, "moe_router_bias_update_rate")
    moe_router_force_load_balancing: bool = _field(
        False, "moe_router_force_load_balancing", "Benchmark mode: route to balanced experts regardless of the "
        "router (the published MoE throughput tables use it).")
    moe_expert_capacity_factor: float | None = _field(
        None, "moe_expert_capacity_factor", "None: dropless; else each expert takes at most this factor times its "
        "even share of the routed tokens.")
    moe_token_drop_policy: str = _field("probs", "moe_token_drop_policy",
                                        "probs | position: over capacity, drop the lowest-weight or the latest tokens.")
    moe_pad_expert_input_to_capacity: bool = _field(False, "moe_pad_expert_input_to_capacity",
                                                    "With a capacity factor: every expert computes exactly capacity rows.")

    @property
    def num_kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self) -> int:
        """Vocab rounded up to make_vocab_size_divisible_by. Unlike Megatron it does not depend on tp, so
        checkpoints restore onto any layout; validation requires it to be divisible by tp."""
        multiple = self.make_vocab_size_divisible_by
        return math.ceil(self.vocab_size / multiple) * multiple


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tp: int = _field(1, "tp", "Tensor-parallel size.")
    pp: int = _field(1, "pp", "Pipeline-parallel size.")
    vpp: int = _field(1, "vpp", "Virtual pipeline stages per device (needs --pipeline_schedule=interleaved).")
    pipeline_schedule: str = _field(
        "1f1b", "pipeline_schedule",
        "gpipe | 1f1b | interleaved: all forwards then all backwards; one forward and one backward per tick "
        "(activation memory bounded by --pp, not by micro-batches); --vpp virtual stages per device, visited "
        "circularly.")
    decoder_first_pipeline_num_layers: int | None = _field(
        None, "decoder_first_pipeline_num_layers", "Uneven pipeline split (Megatron); not supported.")
    decoder_last_pipeline_num_layers: int | None = _field(
        None, "decoder_last_pipeline_num_layers", "Uneven pipeline split (Megatron); not supported.")
    ep: int = _field(1, "ep", "Expert-parallel size.")
    cp: int = _field(1, "cp", "Context-parallel size.")
    fsdp: int = _field(1, "fsdp", "Fully-sharded data-parallel size.")
    dp: int = _field(-1, "dp", "Data-parallel size; -1 fills the remaining devices.")
    sequence_parallel: bool = _field(False, "sequence_parallel")
    use_distributed_optimizer: bool = _field(False, "use_distributed_optimizer", "ZeRO-1.")
    coordinator_address: str | None = _field(None, "coordinator_address", "host:port of process 0 (multi-host).")
    num_processes: int | None = _field(None, "num_processes")
    process_id: int | None = _field(None, "process_id")


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    compute_dtype: str = _field("bfloat16", help="bfloat16 | float16 | float32 (--bf16/--fp16 set it).")
    params_dtype: str = _field("float32", help="Master parameter dtype.")
    loss_scale: float | None = _field(None, "loss_scale", "Static fp16 loss scale; None means dynamic.")
    initial_loss_scale: float = _field(2.0**32, "initial_loss_scale")
    min_loss_scale: float = _field(1.0, "min_loss_scale")
    loss_scale_window: int = _field(1000, "loss_scale_window")
    hysteresis: int = _field(2, "hysteresis")
    # FP8 / FP4 linear layers (mjax/kernels/quant.py). Unset recipes train every GEMM in compute_dtype.
    fp8_recipe: str | None = _field(
        None, "fp8_recipe", "delayed | tensorwise | blockwise: FP8 GEMMs (forward, dgrad, wgrad) with scales from an "
        "amax history, from this step's amax, or per 1x128 activation / 128x128 weight block.")
    fp8_format: str = _field("hybrid", "fp8_format", "e4m3 (every GEMM operand) | hybrid (e4m3 forward, e5m2 grads).")
    fp8_amax_history_len: int = _field(1, "fp8_amax_history_len", "Steps of amax history (delayed scaling).")
    fp8_amax_compute_algo: str = _field("most_recent", "fp8_amax_compute_algo",
                                        "most_recent | max: the amax a delayed scale is computed from.")
    fp8_margin: int = _field(0, "fp8_margin", "Scales are divided by 2^margin (headroom against overflow).")
    fp8_log_stats: bool = _field(False, "fp8_log_stats", "Log FP8 amax/scale statistics at each logged step.")
    fp8_keep_casts: bool = _field(
        True, "fp8_keep_casts", "Under --remat_policy=selective with per-tensor FP8 (delayed | tensorwise), also keep "
        "each GEMM's FP8 operands and scales (remat name fp8_cast) for its backward, as Transformer Engine keeps its "
        "FP8 copies, instead of recomputing the amaxes and casts there (1 byte an element; --nofp8_keep_casts "
        "trades that memory for the recompute).")
    fp4_recipe: str | None = _field(
        None, "fp4_recipe", "nvfp4 | mxfp4: e2m1 GEMM inputs with 16-element e4m3 (+ fp32 tensor) or 32-element "
        "e8m0 block scales, emulated on Hopper (quantize -> dequantize -> bf16 GEMM).")
    fp4_hadamard: bool = _field(False, "fp4_hadamard", "Random Hadamard transform on the FP4 wgrad inputs.")
    fp4_stochastic_rounding: bool = _field(
        False, "fp4_stochastic_rounding", "Round the FP4 copies of the output gradient (dgrad and wgrad inputs) "
        "stochastically instead of to nearest.")
    first_last_layers_bf16: bool = _field(
        False, "first_last_layers_bf16", "Keep the first/last transformer layers of an FP8/FP4 run in compute_dtype.")
    num_layers_at_start_in_bf16: int = _field(1, "num_layers_at_start_in_bf16")
    num_layers_at_end_in_bf16: int = _field(1, "num_layers_at_end_in_bf16")
    quantize_output_layer: bool = _field(
        False, "quantize_output_layer", "Quantize the output layer too (the LM head, or the "
        "tied embedding's use as one); by default it stays in compute_dtype, as do the embedding lookup and the MoE "
        "router.")
    quant_impl: str = _field("auto", "quant_impl", "auto | xla | pallas: kernels of the quantization (per-tensor FP8: "
                             "cast-transpose; blockwise FP8: GEMM; FP4: quantize) (auto: pallas on GPU, the pure-JAX "
                             "reference elsewhere).")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    optimizer: str = _field("adamw", "optimizer", "adamw | sgd")
    lr: float = _field(3e-4, "lr")
    min_lr: float = _field(0.0, "min_lr")
    lr_decay_style: str = _field("cosine", "lr_decay_style", "constant | linear | cosine | wsd")
    lr_warmup_iters: int = _field(0, "lr_warmup_iters")
    lr_decay_iters: int | None = _field(None, "lr_decay_iters", "None means train_iters.")
    lr_wsd_decay_iters: int | None = _field(None, "lr_wsd_decay_iters", "WSD: length of the final decay.")
    lr_wsd_decay_style: str = _field("linear", "lr_wsd_decay_style", "linear | cosine | minus_sqrt")
    weight_decay: float = _field(0.1, "weight_decay")
    adam_beta1: float = _field(0.9, "adam_beta1")
    adam_beta2: float = _field(0.95, "adam_beta2")
    adam_eps: float = _field(1e-8, "adam_eps")
    clip_grad: float = _field(1.0, "clip_grad", "Global-norm clip; 0 disables.")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    train_iters: int = _field(100, "train_iters")
    global_batch_size: int = _field(8, "global_batch_size")
    micro_batch_size: int | None = _field(None, "micro_batch_size", "None means no accumulation.")
    seq_length: int = _field(128, "seq_length")
    seed: int = _field(1234, "seed")
    z_loss_coeff: float = _field(0.0, "z_loss_coeff", "Weight of log(Z)^2 in the loss (PaLM z-loss).")
    on_nonfinite: str = _field("stop", "on_nonfinite", "stop | skip: a NaN/Inf loss or grad norm.")
    eval_interval: int = _field(0, "eval_interval", "0 disables evaluation.")
    eval_iters: int = _field(10, "eval_iters")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    mock_data: bool = _field(False, "mock_data", "Synthetic random tokens.")
    data_path: tuple[str, ...] = _field((), "data_path", "Prefixes of .bin/.idx datasets, optionally weighted.")
    split: str = _field("969,30,1", "split")
    tokenizer_type: str = _field("sample", "tokenizer_type", "sample | huggingface | tiktoken")
    tokenizer_model: str | None = _field(None, "tokenizer_model")
    eod_mask_loss: bool = _field(False, "eod_mask_loss")
    reset_position_ids: bool = _field(False, "reset_position_ids")
    reset_attention_mask: bool = _field(False, "reset_attention_mask", "Segment ids at document boundaries.")
    data_cache_path: str | None = _field(None, "data_cache_path")
    prefetch: int = _field(2, help="Batches prepared ahead in a background thread.")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = _field(None, "save")
    load: str | None = _field(None, "load")
    load_step: int | None = _field(None, "ckpt_step")
    save_interval: int = _field(0, "save_interval")
    keep: int | None = _field(None, "keep")
    async_save: bool = _field(True, "async_save")
    load_params_only: bool = _field(False, "load_params_only", "Weights only: fresh optimizer and step.")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = _field(10, "log_interval")
    metrics_file: str | None = _field(None, "metrics_file", "JSON lines, one per logged step.")
    tensorboard_dir: str | None = _field(None, "tensorboard_dir")
    progress: bool = _field(True, "progress", "A progress bar on a terminal.")
    peak_tflops: float | None = _field(None, "peak_tflops", "MFU denominator; None means the device's.")


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
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

    def validate(self, num_devices: int = 1) -> "Config":
        from mjax.config_validation import validate

        validate(self, num_devices)
        return self


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


def from_dict(d: dict) -> Config:
    """Inverse of `Config.to_dict`; lists become tuples; unknown keys are errors."""
    sections = {}
    for section, fields in d.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section {section!r}")
        sections[section] = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    return Config().replace(**sections)


def configs_dir() -> Path:
    return Path(os.environ.get("MJAX_CONFIGS_DIR", Path(__file__).resolve().parent.parent / "configs"))


def preset_names() -> list[str]:
    return sorted(p.stem for p in configs_dir().glob("*.py") if not p.stem.startswith("_"))


def load_config(name_or_path: str) -> Config:
    """A preset name (`llama3.2-1b`), a `.py` file defining `config() -> Config`, or a `.json` of `to_dict()`."""
    path = Path(name_or_path)
    if not path.suffix or not path.exists():
        stem = name_or_path.replace(".", "_").replace("-", "_")
        path = configs_dir() / f"{stem}.py"
        if not path.exists():
            raise ConfigError(
                f"--config={name_or_path}: no such preset or file. Presets: {', '.join(preset_names())}")
    if path.suffix == ".json":
        return from_dict(json.loads(path.read_text()))
    if path.suffix != ".py":
        raise ConfigError(f"--config={name_or_path}: expected a preset name, a .py or a .json file")
    spec = importlib.util.spec_from_file_location(f"mjax_preset_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "config"):
        raise ConfigError(f"{path} defines no `config()` function returning mjax.config.Config")
    return module.config()
