"""Plain-word checks of a Config, run before anything is traced. Each message names the flag to change."""

from mjax.config import Config, ConfigError
from mjax.kernels import attention, fp8, quant
from mjax.model.rope import qkv_kernel_tiles

REMAT_NAMES = ("qkv_proj", attention.ATTN_CORE, "attn_context", "attn_out", "mlp_up", "mlp_hidden",
               "mlp_out", "norm", fp8.FP8_CAST)
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")


def _choice(value, allowed, flag):
    if value not in allowed:
        raise ConfigError(f"--{flag}={value!r} is not one of: {', '.join(map(str, allowed))}")


def _positive(value, flag):
    if value is None or value <= 0:
        raise ConfigError(f"--{flag} must be a positive number, got {value}")


def resolve_data_parallel(cfg: Config, num_devices: int) -> int:
    """The `dp` mesh-axis size: explicit, or the devices left after the other axes (dp=-1)."""
    p = cfg.parallel
    for name in ("tp", "pp", "vpp", "ep", "cp", "fsdp"):
        _positive(getattr(p, name), name)
    others = p.tp * p.pp * p.ep * p.cp * p.fsdp
    if p.dp == -1:
        if num_devices % others:
            raise ConfigError(
                f"{num_devices} devices cannot be split into tp={p.tp} x pp={p.pp} x ep={p.ep} x cp={p.cp} x "
                f"fsdp={p.fsdp} (product {others}); change those flags so their product divides {num_devices}")
        return num_devices // others
    _positive(p.dp, "dp")
    if others * p.dp != num_devices:
        raise ConfigError(
            f"the mesh tp={p.tp} x pp={p.pp} x ep={p.ep} x cp={p.cp} x fsdp={p.fsdp} x dp={p.dp} = "
            f"{others * p.dp} devices, but {num_devices} are present; set --dp=-1 to fill them")
    return p.dp


def resolve_batch(cfg: Config, num_devices: int) -> tuple[int, int, int]:
    """(batch shards, micro-batch per shard, micro-batches per step) with Megatron's meaning:
    global_batch_size = micro_batch_size x data-parallel size x number of micro-batches."""
    t, p = cfg.train, cfg.parallel
    _positive(t.global_batch_size, "global_batch_size")
    shards = resolve_data_parallel(cfg, num_devices) * p.fsdp * p.ep
    if t.global_batch_size % shards:
        raise ConfigError(
            f"--global_batch_size={t.global_batch_size} is not divisible by the data-parallel size {shards} "
            f"(dp x fsdp x ep)")
    micro = t.micro_batch_size or t.global_batch_size // shards
    _positive(micro, "micro_batch_size")
    if t.global_batch_size % (shards * micro):
        raise ConfigError(
            f"--global_batch_size={t.global_batch_size} is not divisible by data-parallel size {shards} "
            f"x --micro_batch_size={micro}")
    return shards, micro, t.global_batch_size // (shards * micro)


def validate_model(cfg: Config) -> None:
    m, tp = cfg.model, cfg.parallel.tp
    for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                 "make_vocab_size_divisible_by", "max_position_embeddings"):
        _positive(getattr(m, name), f"model.{name}")
    _choice(m.normalization, ("rmsnorm", "layernorm"), "model.normalization")
    _choice(m.activation, ("swiglu", "gelu"), "model.activation")
    _choice(m.position_embedding_type, ("rope", "learned"), "model.position_embedding_type")
    _choice(m.rope_scaling, ("none", "llama3"), "model.rope_scaling")
    _choice(m.attention_impl, attention.IMPLS, "model.attention_impl")
    _choice(m.qkv_grad_impl, ("auto", "xla", "pallas"), "model.qkv_grad_impl")
    if m.qkv_grad_impl == "pallas" and not qkv_kernel_tiles(m.head_dim):
        raise ConfigError(f"--model.qkv_grad_impl=pallas needs half the head dim (--kv_channels) to be a power of two "
                          f"(Triton's tile sizes), got head dim {m.head_dim}; use --model.qkv_grad_impl=xla")
    _choice(m.cross_entropy_impl, ("reference", "fused"), "cross_entropy_impl")
    _positive(m.cross_entropy_chunk, "cross_entropy_chunk")
    _choice(m.remat_policy, ("none", "selective", "full"), "model.remat_policy")
    for name in m.remat_save_names:
        _choice(name, REMAT_NAMES, "model.remat_save_names")
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"--model.hidden_size={m.hidden_size} is not divisible by --model.num_attention_heads="
            f"{m.num_attention_heads}; set --model.kv_channels explicitly or change one of them")
    if m.num_attention_heads % m.num_kv_heads:
        raise ConfigError(
            f"--model.num_attention_heads={m.num_attention_heads} is not a multiple of "
            f"--model.num_query_groups={m.num_kv_heads}")
    if m.position_embedding_type == "rope" and m.head_dim % 2:
        raise ConfigError(f"RoPE needs an even head dim, got {m.head_dim} (--model.kv_channels)")
    if m.sliding_window is not None:
        _positive(m.sliding_window, "model.window_size")
    if m.num_experts is not None:
        raise ConfigError(f"model {m.name!r} has --num_experts={m.num_experts}: MoE layers are not implemented yet")
    if cfg.parallel.ep > 1:
        raise ConfigError(f"--ep={cfg.parallel.ep} needs MoE layers (--num_experts), which are not implemented yet")
    if m.num_attention_heads % tp:
        raise ConfigError(f"--model.num_attention_heads={m.num_attention_heads} is not divisible by --tp={tp}")
    if m.num_kv_heads % tp and tp % m.num_kv_heads:
        raise ConfigError(
            f"--model.num_query_groups={m.num_kv_heads} and --tp={tp}: one must divide the other "
            "(KV heads are split over tp, or replicated when fewer than tp)")
    if m.qkv_grad_impl == "pallas" and (m.position_embedding_type != "rope" or m.num_kv_heads % tp):
        raise ConfigError(  # the kernel is the backward of the fused projection's split with RoPE, nothing else
            f"--model.qkv_grad_impl=pallas needs RoPE and the fused QKV projection (KV heads split over tp); got "
            f"--position_embedding_type={m.position_embedding_type}, --model.num_query_groups={m.num_kv_heads}, "
            f"--tp={tp}; use --model.qkv_grad_impl=auto or xla")
    if m.padded_vocab_size() % tp:
        raise ConfigError(
            f"the padded vocab {m.padded_vocab_size()} is not divisible by --tp={tp}; set "
            "--make_vocab_size_divisible_by to a multiple of tp")
    if m.ffn_hidden_size % tp:
        raise ConfigError(f"--model.ffn_hidden_size={m.ffn_hidden_size} is not divisible by --tp={tp}")
    if m.position_embedding_type == "learned" and cfg.train.seq_length > m.max_position_embeddings:
        raise ConfigError(
            f"--seq_length={cfg.train.seq_length} exceeds --model.max_position_embeddings="
            f"{m.max_position_embeddings} of the learned position table")


def validate_pipeline(cfg: Config, num_devices: int) -> None:
    p, layers = cfg.parallel, cfg.model.num_layers
    _choice(p.pipeline_schedule, PIPELINE_SCHEDULES, "pipeline_schedule")
    for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        if getattr(p, name) is not None:
            raise ConfigError(
                f"--{name} (an uneven pipeline split) is not supported: all pipeline stages run one SPMD program, "
                "so each holds --model.num_layers / (--pp x --vpp) layers; unset it")
    if layers % (p.pp * p.vpp):
        raise ConfigError(
            f"--model.num_layers={layers} is not divisible by --pp={p.pp} x --vpp={p.vpp}: every (virtual) pipeline "
            "stage holds the same number of layers and no layer is ever dropped; change one of them")
    if p.vpp > 1 and p.pp == 1:
        raise ConfigError(f"--vpp={p.vpp} needs --pp > 1")
    if p.vpp > 1 and p.pipeline_schedule != "interleaved":
        raise ConfigError(f"--vpp={p.vpp} needs --pipeline_schedule=interleaved (got {p.pipeline_schedule})")
    if p.pp > 1 and p.pipeline_schedule == "interleaved" and p.vpp == 1:
        raise ConfigError("--pipeline_schedule=interleaved needs --vpp >= 2 virtual stages per device; "
                          "with --vpp=1 use gpipe or 1f1b")
    shards, micro_size, micro = resolve_batch(cfg, num_devices)
    if micro < p.pp:
        raise ConfigError(
            f"{micro} micro-batch(es) per step (--global_batch_size={cfg.train.global_batch_size} / (data-parallel "
            f"size {shards} x --micro_batch_size={micro_size})) are fewer than the --pp={p.pp} pipeline stages, so "
            f"stages would idle; lower --micro_batch_size or raise --global_batch_size to get at least {p.pp}")


def validate_quantization(cfg: Config, num_devices: int) -> None:
    """--fp8_* / --fp4_* flags (mjax/kernels/quant.py)."""
    pr, m = cfg.precision, cfg.model
    _choice(pr.compute_dtype, ("bfloat16", "float16", "float32"), "precision.compute_dtype")
    _choice(pr.fp8_recipe, (None, *quant.FP8_RECIPES), "fp8_recipe")
    _choice(pr.fp4_recipe, (None, *quant.FP4_RECIPES), "fp4_recipe")
    _choice(pr.fp8_format, ("e4m3", "hybrid"), "fp8_format")
    _choice(pr.fp8_amax_compute_algo, ("most_recent", "max"), "fp8_amax_compute_algo")
    _choice(pr.quant_impl, quant.IMPLS, "quant_impl")
    _positive(pr.fp8_amax_history_len, "fp8_amax_history_len")
    if pr.fp8_margin < 0:
        raise ConfigError(f"--fp8_margin must be >= 0, got {pr.fp8_margin}")
    if fp8.FP8_CAST in m.remat_save_names and pr.fp8_recipe not in ("delayed", "tensorwise"):
        raise ConfigError(f"--model.remat_save_names has fp8_cast, which only per-tensor FP8 GEMMs name "
                          f"(--fp8_recipe=delayed|tensorwise), not --fp8_recipe={pr.fp8_recipe} "
                          f"--fp4_recipe={pr.fp4_recipe}; drop it")
    for flag in ("fp4_hadamard", "fp4_stochastic_rounding"):
        if getattr(pr, flag) and pr.fp4_recipe is None:
            raise ConfigError(f"--{flag} applies to FP4 GEMMs; it needs --fp4_recipe=nvfp4|mxfp4")
    if pr.fp8_recipe is None and pr.fp4_recipe is None:
        return
    if pr.fp8_recipe is not None and pr.fp4_recipe is not None:
        raise ConfigError(f"--fp8_recipe={pr.fp8_recipe} and --fp4_recipe={pr.fp4_recipe} are both set; choose one")
    if pr.compute_dtype == "float16":
        raise ConfigError("FP8/FP4 training runs with --bf16 (or float32) compute, not --fp16")
    if pr.first_last_layers_bf16:
        start, end = pr.num_layers_at_start_in_bf16, pr.num_layers_at_end_in_bf16
        if start < 0 or end < 0 or start + end >= m.num_layers:
            raise ConfigError(
                f"--num_layers_at_start_in_bf16={start} + --num_layers_at_end_in_bf16={end} must leave at least one "
                f"of the {m.num_layers} layers quantized (and neither may be negative)")
        if cfg.parallel.pp > 1:
            raise ConfigError("--first_last_layers_bf16 is not supported with --pp > 1 yet")
    if pr.fp8_recipe is not None and cfg.parallel.pp > 1:
        raise ConfigError(f"--fp8_recipe={pr.fp8_recipe} with --pp={cfg.parallel.pp} is not supported yet: the "
                          "pipeline stages do not carry the FP8 scaling state; drop one of them")
    if pr.quantize_output_layer and m.cross_entropy_impl == "fused" and pr.fp8_recipe not in ("delayed", "tensorwise"):
        raise ConfigError(f"--quantize_output_layer with --cross_entropy_impl=fused quantizes with per-tensor FP8 "
                          f"(--fp8_recipe=delayed|tensorwise), not --fp8_recipe={pr.fp8_recipe} "
                          f"--fp4_recipe={pr.fp4_recipe}; use --cross_entropy_impl=reference")
    if pr.fp8_recipe == "blockwise":
        _, micro, _ = resolve_batch(cfg, num_devices)
        dims = {"--hidden_size": m.hidden_size, "--ffn_hidden_size": m.ffn_hidden_size,
                "--num_attention_heads x --kv_channels": m.num_attention_heads * m.head_dim,
                "--num_query_groups x --kv_channels": m.num_kv_heads * m.head_dim,
                "--micro_batch_size x --seq_length (tokens per micro-batch)": micro * cfg.train.seq_length}
        if pr.quantize_output_layer:
            dims["the padded vocab (--make_vocab_size_divisible_by)"] = m.padded_vocab_size()
        bad = [f"{k}={v}" for k, v in dims.items() if v % 128]
        if bad:
            raise ConfigError(f"--fp8_recipe=blockwise needs GEMM sizes that are multiples of 128: {', '.join(bad)}; "
                              "change them or use --fp8_recipe=tensorwise")


def validate(cfg: Config, num_devices: int = 1) -> None:
    validate_model(cfg)
    p, t, o, pr = cfg.parallel, cfg.train, cfg.optimizer, cfg.precision
    resolve_data_parallel(cfg, num_devices)
    if p.sequence_parallel and t.seq_length % p.tp:
        raise ConfigError(f"--sequence_parallel: --seq_length={t.seq_length} is not divisible by --tp={p.tp}")
    if t.seq_length % p.cp:
        raise ConfigError(f"--seq_length={t.seq_length} is not divisible by --cp={p.cp}")

    _positive(t.train_iters, "train_iters")
    _positive(t.seq_length, "seq_length")
    validate_quantization(cfg, num_devices)
    validate_pipeline(cfg, num_devices)
    _choice(t.on_nonfinite, ("stop", "skip"), "train.on_nonfinite")
    if t.z_loss_coeff < 0:
        raise ConfigError(f"--z_loss_coeff must be >= 0, got {t.z_loss_coeff}")

    _choice(pr.params_dtype, ("float32", "bfloat16", "float16"), "precision.params_dtype")
    if pr.loss_scale is not None and pr.loss_scale <= 0:
        raise ConfigError(f"--loss_scale must be positive, got {pr.loss_scale}")

    _choice(o.optimizer, ("adamw", "sgd"), "optimizer")
    _choice(o.lr_decay_style, ("constant", "linear", "cosine", "wsd"), "lr_decay_style")
    _choice(o.lr_wsd_decay_style, ("linear", "cosine", "minus_sqrt"), "lr_wsd_decay_style")
    if o.lr < 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise ConfigError(f"need 0 <= --min_lr <= --lr, got min_lr={o.min_lr}, lr={o.lr}")
    if o.lr_warmup_iters < 0:  # a warmup longer than the run is allowed: short runs of long-run presets
        raise ConfigError(f"--lr_warmup_iters must be >= 0, got {o.lr_warmup_iters}")
    if o.lr_decay_iters is not None and o.lr_decay_iters <= 0:
        raise ConfigError(f"--lr_decay_iters must be positive, got {o.lr_decay_iters}")
    if o.lr_decay_style == "wsd" and not o.lr_wsd_decay_iters:
        raise ConfigError("--lr_decay_style=wsd needs --lr_wsd_decay_iters (the length of the final decay)")
    if o.clip_grad < 0:
        raise ConfigError(f"--clip_grad must be >= 0, got {o.clip_grad}")

    _positive(cfg.logging.log_interval, "log_interval")
    c = cfg.checkpoint
    if c.save_interval < 0:
        raise ConfigError("--save_interval must be >= 0")
    for flag, given in (("--ckpt_step", c.load_step is not None), ("--load_params_only", c.load_params_only)):
        if given and not c.load:
            raise ConfigError(f"{flag} says what to read from --load, but --load is not set")
