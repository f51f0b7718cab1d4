"""Plain-word checks of a Config, run before anything is traced. Each message names the flag to change."""

import logging

from mjax.config import model as model_options
from mjax.config.model import MOE_REMAT_NAMES
from mjax.config.base import ConfigError
from mjax.config.pipeline_layout import stage_layout
from mjax.config.validate_mla import validate_mla
from mjax.config.validate_mtp import validate_mtp
from mjax.config.sections import Config
from mjax.kernels import options as kernels

REMAT_NAMES = ("qkv_proj", "mla_up", kernels.ATTN_CORE, "attn_context", "attn_out", "mlp_up", "mlp_hidden",
               "mlp_out", "norm", kernels.FP8_CAST, *MOE_REMAT_NAMES)
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "interleaved_1f1b", "zero_bubble")
INTERLEAVED = ("interleaved_1f1b", "interleaved")  # the schedules with --vpp > 1 chunks per device
log = logging.getLogger("mjax")


def choice(value, allowed, flag):
    if value not in allowed:
        raise ConfigError(f"--{flag}={value!r} is not one of: {', '.join(map(str, allowed))}")


def positive(value, flag):
    if value is None or value <= 0:
        raise ConfigError(f"--{flag} must be a positive number, got {value}")


def validate_model(cfg: Config) -> None:
    m, tp = cfg.model, cfg.parallel.tp
    for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                 "make_vocab_size_divisible_by", "max_position_embeddings"):
        positive(getattr(m, name), f"model.{name}")
    choice(m.normalization, ("rmsnorm", "layernorm"), "model.normalization")
    choice(m.activation, ("swiglu", "gelu"), "model.activation")
    choice(m.position_embedding_type, ("rope", "learned"), "model.position_embedding_type")
    choice(m.rope_scaling, ("none", "llama3", "yarn"), "model.rope_scaling")
    validate_mla(m)
    validate_mtp(cfg)
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
    if m.window_size is not None:
        positive(m.window_size, "window_size")
    validate_moe(cfg)
    if m.num_attention_heads % tp:
        raise ConfigError(f"--model.num_attention_heads={m.num_attention_heads} is not divisible by --tp={tp}")
    if m.num_kv_heads % tp and tp % m.num_kv_heads:
        raise ConfigError(
            f"--model.num_query_groups={m.num_kv_heads} and --tp={tp}: one must divide the other "
            "(KV heads are split over tp, or replicated when fewer than tp)")
    if m.qk_layernorm_across_heads and not m.qk_layernorm:
        raise ConfigError("--qk_layernorm_across_heads needs --qk_layernorm")
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


def validate_execution(cfg: Config) -> None:
    """--attention_impl, --qkv_grad_impl, --cross_entropy_impl, --remat_* ... (mjax/config/execution.py)."""
    e, m, tp = cfg.execution, cfg.model, cfg.parallel.tp
    choice(e.attention_impl, kernels.ATTENTION_IMPLS, "attention_impl")
    choice(e.qkv_grad_impl, kernels.QKV_GRAD_IMPLS, "qkv_grad_impl")
    if e.qkv_grad_impl == "pallas" and not kernels.qkv_kernel_tiles(m.head_dim):
        raise ConfigError(f"--qkv_grad_impl=pallas needs half the head dim (--kv_channels) to be a power of two "
                          f"(Triton's tile sizes), got head dim {m.head_dim}; use --qkv_grad_impl=xla")
    if e.qkv_grad_impl == "pallas" and (m.position_embedding_type != "rope" or m.num_kv_heads % tp):
        raise ConfigError(  # the kernel is the backward of the fused projection's split with RoPE, nothing else
            f"--qkv_grad_impl=pallas needs RoPE and the fused QKV projection (KV heads split over tp); got "
            f"--position_embedding_type={m.position_embedding_type}, --num_query_groups={m.num_kv_heads}, "
            f"--tp={tp}; use --qkv_grad_impl=auto or xla")
    if e.qkv_grad_impl == "pallas" and m.qk_layernorm:
        raise ConfigError("--qkv_grad_impl=pallas fuses the QKV split with RoPE, which --qk_layernorm puts a norm "
                          "between; use --qkv_grad_impl=auto or xla")
    choice(e.cross_entropy_impl, kernels.CROSS_ENTROPY_IMPLS, "cross_entropy_impl")
    positive(e.cross_entropy_chunk, "cross_entropy_chunk")
    choice(e.moe_grouped_gemm_impl, model_options.MOE_GROUPED_GEMM_IMPLS, "moe_grouped_gemm_impl")
    choice(e.moe_alltoall_impl, model_options.MOE_ALLTOALL_IMPLS, "moe_alltoall_impl")
    choice(e.remat_policy, ("none", "selective", "full"), "remat_policy")
    for name in e.remat_save_names:
        choice(name, REMAT_NAMES, "remat_save_names")


def validate_moe(cfg: Config) -> None:
    """--num_experts and the --moe_* flags (mjax/model/moe.py, mjax/model/router.py)."""
    m, p, tp = cfg.model, cfg.parallel, cfg.parallel.tp
    choice(p.moe_token_dispatcher_type, model_options.MOE_TOKEN_DISPATCHER_TYPES, "moe_token_dispatcher_type")
    if m.num_experts is None:
        if p.ep > 1:
            raise ConfigError(f"--ep={p.ep} splits the experts of an MoE model, and this model has none "
                              "(--num_experts); use --ep=1 (or --dp for data parallelism)")
        return
    validate_expert_parallel(cfg)
    positive(m.num_experts, "num_experts")
    e, k = m.num_experts, m.moe_router_topk
    if not 1 <= k <= e:
        raise ConfigError(f"--moe_router_topk={k} must be between 1 and --num_experts={e}")
    choice(m.moe_router_score_function, model_options.MOE_SCORE_FUNCTIONS, "moe_router_score_function")
    choice(m.moe_router_load_balancing_type, model_options.MOE_LOAD_BALANCING_TYPES, "moe_router_load_balancing_type")
    choice(m.moe_token_drop_policy, model_options.MOE_DROP_POLICIES, "moe_token_drop_policy")
    choice(m.moe_router_dtype, model_options.MOE_ROUTER_DTYPES, "moe_router_dtype")
    pattern = m.moe_layer_pattern()  # raises for a malformed --moe_layer_freq
    if not any(pattern):
        raise ConfigError(f"--num_experts={e} but no layer is MoE (--moe_layer_freq={m.moe_layer_freq}, "
                          f"--moe_first_dense_layers={m.moe_first_dense_layers})")
    if not 0 <= m.moe_first_dense_layers < m.num_layers:
        raise ConfigError(f"--moe_first_dense_layers={m.moe_first_dense_layers} must be in 0..{m.num_layers - 1}")
    for name, split in (("moe_ffn_hidden_size", expert_tensor_parallel_size(p)),
                        ("moe_shared_expert_intermediate_size", tp)):
        if getattr(m, name) is not None:
            positive(getattr(m, name), name)
            if getattr(m, name) % split:
                raise ConfigError(f"--{name}={getattr(m, name)} is not divisible by the {split} tensor-parallel "
                                  "ranks that split it")
    if m.moe_shared_expert_gate and not m.moe_shared_expert_intermediate_size:
        raise ConfigError("--moe_shared_expert_gate needs --moe_shared_expert_intermediate_size (the shared experts)")
    if (m.moe_router_num_groups is None) != (m.moe_router_group_topk is None):
        raise ConfigError("group-limited routing needs both --moe_router_num_groups and --moe_router_group_topk")
    if m.moe_router_num_groups is not None:
        groups, chosen = m.moe_router_num_groups, m.moe_router_group_topk
        if groups < 1 or e % groups:
            raise ConfigError(f"--moe_router_num_groups={groups} must divide --num_experts={e}")
        if not 1 <= chosen <= groups or k > chosen * (e // groups):
            raise ConfigError(f"--moe_router_group_topk={chosen} must be in 1..{groups} and its groups must hold the "
                              f"--moe_router_topk={k} experts ({e // groups} experts per group)")
        score_k = m.moe_router_group_score_topk
        if score_k is not None and not 1 <= score_k <= e // groups:
            raise ConfigError(f"--moe_router_group_score_topk={score_k} must be in 1..{e // groups} (the experts per "
                              "group)")
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        raise ConfigError("--moe_router_enable_expert_bias needs --moe_router_score_function=sigmoid (as in "
                          "Megatron-LM)")
    if m.moe_aux_loss_coeff < 0 or m.moe_z_loss_coeff < 0:
        raise ConfigError("--moe_aux_loss_coeff and --moe_z_loss_coeff must be >= 0")
    if m.moe_expert_capacity_factor is not None and m.moe_expert_capacity_factor <= 0:
        raise ConfigError(f"--moe_expert_capacity_factor={m.moe_expert_capacity_factor} must be positive (unset it for "
                          "dropless)")
    if m.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor is None:
        raise ConfigError("--moe_pad_expert_input_to_capacity needs --moe_expert_capacity_factor")
    if m.add_bias_linear:
        raise ConfigError("--add_bias_linear: MoE experts have no biases; unset it for MoE models")
    pr = cfg.precision
    if pr.fp4_recipe in kernels.FP4_RECIPES:
        raise ConfigError(f"--fp4_recipe={pr.fp4_recipe} with MoE layers is not supported: the expert GEMMs run in "
                          "FP8 with --fp8_recipe=delayed|tensorwise|blockwise, or in the compute dtype; drop "
                          "--fp4_recipe")
    if pr.fp8_recipe == "blockwise" and m.moe_ffn_hidden_size:  # the grouped GEMMs' N and K (linear layers pad)
        check_blockwise_dims({"--moe_ffn_hidden_size": m.moe_ffn_hidden_size})
    if p.pp > 1:
        if p.vpp > 1 and pipeline_schedule(p) != "interleaved_1f1b":
            raise ConfigError(f"--vpp={p.vpp} with MoE layers runs with --pipeline_schedule=interleaved_1f1b (what "
                              f"--vpp selects when the schedule is unset), not {pipeline_schedule(p)}")
        for flag, bad in (("moe_router_load_balancing_type=global_aux_loss",
                           m.moe_router_load_balancing_type == "global_aux_loss"),
                          ("moe_router_force_load_balancing", m.moe_router_force_load_balancing)):
            if bad:
                raise ConfigError(f"--{flag} is not supported with --pp > 1 yet")


def expert_tensor_parallel_size(p) -> int:
    """The experts' tensor-parallel size: --expert_tensor_parallel_size, by default --tp."""
    return p.tp if p.expert_tensor_parallel_size is None else p.expert_tensor_parallel_size


def validate_expert_parallel(cfg: Config) -> None:
    """--ep, --expert_tensor_parallel_size and the token dispatcher (mjax/parallel/token_dispatcher.py)."""
    m, p, pr = cfg.model, cfg.parallel, cfg.precision
    etp = expert_tensor_parallel_size(p)
    if etp not in (1, p.tp):
        raise ConfigError(f"--expert_tensor_parallel_size={etp} must be 1 or --tp={p.tp} (unset: --tp)")
    ranks = p.ep * (p.tp if etp == 1 else 1)  # the devices one layer's experts are split over
    if m.num_experts % ranks:
        split = f"--ep={p.ep}" + (f" x --tp={p.tp} (--expert_tensor_parallel_size=1)" if ranks != p.ep else "")
        raise ConfigError(f"--num_experts={m.num_experts} is not divisible by {split}: each rank holds a whole "
                          "number of experts")
    if etp == 1 and p.tp > 1:
        if cfg.train.seq_length % p.tp:
            raise ConfigError(f"--expert_tensor_parallel_size=1: --seq_length={cfg.train.seq_length} must divide "
                              f"over --tp={p.tp} (the tensor-parallel ranks dispatch their part of the tokens)")
        if m.moe_expert_capacity_factor is not None:
            raise ConfigError("--moe_expert_capacity_factor with --expert_tensor_parallel_size=1 and --tp > 1 is not "
                              "supported (the capacity is per batch shard); unset one of them")
    if p.moe_token_dispatcher_type == "allgather" and cfg.execution.moe_alltoall_impl != "auto":
        raise ConfigError(f"--moe_alltoall_impl={cfg.execution.moe_alltoall_impl} picks the alltoall dispatcher's "
                          "exchange, and --moe_token_dispatcher_type=allgather has none; drop one of them")
    if p.moe_token_dispatcher_type == "allgather" and m.moe_expert_capacity_factor is not None and ranks > 1:
        raise ConfigError("--moe_expert_capacity_factor needs --moe_token_dispatcher_type=alltoall (as in "
                          "Megatron-LM): the allgather dispatcher is dropless")
    if ranks > 1 and pr.fp8_recipe in kernels.FP8_RECIPES:
        raise ConfigError(f"--fp8_recipe={pr.fp8_recipe} with expert parallelism (--ep={p.ep}) is not supported yet: "
                          "the expert GEMMs' per-tensor scales would need their amax over every rank; use --ep=1 or "
                          "drop --fp8_recipe")


CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def validate_context_parallel(cfg: Config) -> None:
    """--cp, --cp_comm_type, --hierarchical_context_parallel_sizes (mjax/parallel/context_parallel.py)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    choice(p.cp_comm_type, CP_COMM_TYPES, "cp_comm_type")
    sizes = p.hierarchical_context_parallel_sizes
    if sizes is not None and p.cp_comm_type != "a2a+p2p":
        raise ConfigError(f"--hierarchical_context_parallel_sizes is for --cp_comm_type=a2a+p2p, not "
                          f"{p.cp_comm_type}; drop one of them")
    if p.cp == 1:
        return
    if t.seq_length % (2 * p.cp):
        raise ConfigError(f"--seq_length={t.seq_length} must be divisible by 2 x --cp = {2 * p.cp}: each rank holds "
                          "two chunks of every sequence (load-balanced causal attention)")
    if p.sequence_parallel and t.seq_length % (p.cp * p.tp):
        raise ConfigError(f"--sequence_parallel with --cp={p.cp}: --seq_length={t.seq_length} must be divisible by "
                          f"--cp x --tp = {p.cp * p.tp}")
    a2a = {"p2p": 1, "all_gather": 1, "a2a": p.cp}.get(p.cp_comm_type)
    if p.cp_comm_type == "a2a+p2p":
        if sizes is None or len(sizes) != 2 or sizes[0] * sizes[1] != p.cp or min(sizes) < 1:
            raise ConfigError(f"--cp_comm_type=a2a+p2p needs --hierarchical_context_parallel_sizes=A,R (all-to-all "
                              f"group size, ring size) with A x R = --cp={p.cp}; got {sizes}")
        a2a = sizes[0]
    slots = p.tp * a2a
    if a2a > 1:
        if m.num_attention_heads % slots:
            raise ConfigError(f"--cp_comm_type={p.cp_comm_type}: --num_attention_heads={m.num_attention_heads} must "
                              f"split over --tp x the all-to-all ranks = {slots}")
        kv = m.num_kv_heads
        if kv % slots and slots % kv:
            raise ConfigError(f"--cp_comm_type={p.cp_comm_type}: {kv} KV heads (--num_query_groups) must split over "
                              f"or divide --tp x the all-to-all ranks = {slots}")
    if m.num_experts and m.moe_expert_capacity_factor is not None and m.moe_token_drop_policy == "position":
        raise ConfigError(f"--moe_token_drop_policy=position with --cp={p.cp}: the position priority would follow the "
                          "context-parallel token order, not the sequence's; use --moe_token_drop_policy=probs or "
                          "--cp=1")
    ring = p.cp // a2a
    if (ring > 1 or p.cp_comm_type == "all_gather") and cfg.execution.attention_impl == "cudnn":
        raise ConfigError(f"--cp_comm_type={p.cp_comm_type} attends in blocks at run-time offsets, merged by their "
                          "log-sum-exp, and cuDNN gives neither: use --attention_impl=mosaic or pallas (or auto), or "
                          "--cp_comm_type=a2a")


def validate_pipeline(cfg: Config) -> None:
    p, layers = cfg.parallel, cfg.model.num_layers
    choice(pipeline_schedule(p), PIPELINE_SCHEDULES, "pipeline_schedule")
    stage_layout(p, layers)  # raises for counts that do not add up, or a layout string that does not fit
    if p.vpp > 1 and p.pp == 1:
        raise ConfigError(f"--vpp={p.vpp} needs --pp > 1")
    if p.vpp > 1 and pipeline_schedule(p) not in INTERLEAVED:
        raise ConfigError(f"--vpp={p.vpp} needs an interleaved schedule ({' or '.join(INTERLEAVED)}), not "
                          f"--pipeline_schedule={p.pipeline_schedule} (unset: --vpp selects interleaved_1f1b)")
    if p.pp > 1 and pipeline_schedule(p) in INTERLEAVED and p.vpp == 1:
        raise ConfigError(f"--pipeline_schedule={pipeline_schedule(p)} needs --vpp >= 2 virtual stages per device; "
                          "with --vpp=1 use gpipe or 1f1b")
    if p.pp > 1 and pipeline_schedule(p) == "zero_bubble":
        quantized = cfg.precision.fp8_recipe is not None or cfg.precision.fp4_recipe is not None
        unsupported = {"--num_experts (MoE layers)": cfg.model.num_experts is not None,
                       "--fp8_recipe / --fp4_recipe": quantized,
                       "uneven stages (--decoder_first/last_pipeline_num_layers, --account_for_*_in_pipeline_split, "
                       "--pipeline_model_parallel_layout)": not stage_layout(p, layers).even}
        for what, bad in unsupported.items():
            if bad:
                raise ConfigError(f"--pipeline_schedule=zero_bubble does not support {what} yet: use "
                                  "--pipeline_schedule=1f1b")


def pipeline_schedule(p) -> str:
    """--pipeline_schedule, or when unset (as Megatron) interleaved 1F1B with --vpp > 1, else 1f1b."""
    if p.pipeline_schedule is not None:
        return p.pipeline_schedule
    return "interleaved_1f1b" if p.vpp > 1 else "1f1b"


def validate_quantization(cfg: Config) -> None:
    """--fp8_* / --fp4_* flags (mjax/kernels/quant/)."""
    pr, m = cfg.precision, cfg.model
    choice(pr.compute_dtype, ("bfloat16", "float16", "float32"), "precision.compute_dtype")
    choice(pr.fp8_recipe, (None, *kernels.FP8_RECIPES), "fp8_recipe")
    choice(pr.fp4_recipe, (None, *kernels.FP4_RECIPES), "fp4_recipe")
    choice(pr.fp8_format, ("e4m3", "hybrid"), "fp8_format")
    choice(pr.fp8_amax_compute_algo, ("most_recent", "max"), "fp8_amax_compute_algo")
    choice(pr.quant_impl, kernels.QUANT_IMPLS, "quant_impl")
    positive(pr.fp8_amax_history_len, "fp8_amax_history_len")
    if pr.fp8_margin < 0:
        raise ConfigError(f"--fp8_margin must be >= 0, got {pr.fp8_margin}")
    if kernels.FP8_CAST in cfg.execution.remat_save_names and pr.fp8_recipe not in ("delayed", "tensorwise"):
        raise ConfigError(f"--remat_save_names has fp8_cast, which only per-tensor FP8 GEMMs name "
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
    schedule = pipeline_schedule(cfg.parallel)
    if pr.fp8_recipe is not None and cfg.parallel.pp > 1 and schedule not in ("1f1b", "interleaved_1f1b"):
        raise ConfigError(f"--fp8_recipe={pr.fp8_recipe} with --pp={cfg.parallel.pp} runs under "
                          f"--pipeline_schedule=1f1b or interleaved_1f1b (their backward slots take each layer's "
                          f"amax), not {schedule}")
    if (pr.quantize_output_layer and cfg.execution.cross_entropy_impl == "fused"
            and pr.fp8_recipe not in ("delayed", "tensorwise")):
        raise ConfigError(f"--quantize_output_layer with --cross_entropy_impl=fused quantizes with per-tensor FP8 "
                          f"(--fp8_recipe=delayed|tensorwise), not --fp8_recipe={pr.fp8_recipe} "
                          f"--fp4_recipe={pr.fp4_recipe}; use --cross_entropy_impl=reference")
    if pr.fp8_recipe == "blockwise":
        dims = {"--hidden_size": m.hidden_size, "--ffn_hidden_size": m.ffn_hidden_size,
                "--num_attention_heads x --kv_channels": m.num_attention_heads * m.head_dim,
                "--num_query_groups x --kv_channels": m.num_kv_heads * m.head_dim}
        if pr.quantize_output_layer:
            dims["the padded vocab (--make_vocab_size_divisible_by)"] = m.padded_vocab_size()
        check_blockwise_dims(dims)


def check_blockwise_dims(dims: dict) -> None:
    bad = [f"{k}={v}" for k, v in dims.items() if v % 128]
    if bad:
        raise ConfigError(f"--fp8_recipe=blockwise needs GEMM sizes that are multiples of 128: {', '.join(bad)}; "
                          "change them or use --fp8_recipe=tensorwise")


def validate(cfg: Config) -> None:
    """Every check that needs only the config (mjax.parallel.layout.validate_layout adds the device count's)."""
    validate_model(cfg)
    validate_execution(cfg)
    p, t, o, pr = cfg.parallel, cfg.train, cfg.optimizer, cfg.precision
    for name in ("tp", "pp", "vpp", "ep", "cp", "fsdp"):
        positive(getattr(p, name), name)
    if p.dp != -1:
        positive(p.dp, "dp")
    if p.sequence_parallel and t.seq_length % p.tp:
        raise ConfigError(f"--sequence_parallel: --seq_length={t.seq_length} is not divisible by --tp={p.tp}")
    if p.sequence_parallel and p.tp == 1:
        log.warning("--sequence_parallel has no effect with --tp=1 (it splits the sequence over the tensor-parallel "
                    "group); it is ignored")
    validate_context_parallel(cfg)

    positive(t.train_iters, "train_iters")
    positive(t.seq_length, "seq_length")
    positive(t.global_batch_size, "global_batch_size")
    if t.micro_batch_size is not None:
        positive(t.micro_batch_size, "micro_batch_size")
    validate_quantization(cfg)
    validate_pipeline(cfg)
    choice(t.on_nonfinite, ("stop", "skip"), "train.on_nonfinite")
    if t.z_loss_coeff < 0:
        raise ConfigError(f"--z_loss_coeff must be >= 0, got {t.z_loss_coeff}")
    if t.eval_interval < 0:
        raise ConfigError(f"--eval_interval must be >= 0 (0 disables evaluation), got {t.eval_interval}")
    if t.eval_interval:
        positive(t.eval_iters, "eval_iters")

    choice(pr.params_dtype, ("float32", "bfloat16", "float16"), "precision.params_dtype")
    if pr.loss_scale is not None and pr.loss_scale <= 0:
        raise ConfigError(f"--loss_scale must be positive, got {pr.loss_scale}")

    choice(o.optimizer, ("adamw", "sgd"), "optimizer")
    choice(o.lr_decay_style, ("constant", "linear", "cosine", "wsd"), "lr_decay_style")
    choice(o.lr_wsd_decay_style, ("linear", "cosine", "minus_sqrt"), "lr_wsd_decay_style")
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

    positive(cfg.logging.log_interval, "log_interval")
    validate_checkpoint(cfg.checkpoint)


def validate_checkpoint(c) -> None:
    if c.save_interval < 0:
        raise ConfigError("--save_interval must be >= 0")
    if c.save_interval and not c.save:
        raise ConfigError(f"--save_interval={c.save_interval} needs --save (the directory to write checkpoints to)")
    if c.keep is not None and c.keep <= 0:
        raise ConfigError(f"--keep={c.keep}: keep is how many of the latest checkpoints to keep (at least 1); leave "
                          "it unset to keep all")
    for flag, given in (("--ckpt_step", c.ckpt_step is not None), ("--load_params_only", c.load_params_only)):
        if given and not c.load:
            raise ConfigError(f"{flag} says what to read from --load, but --load is not set")
