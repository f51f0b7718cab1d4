"""The model architecture: what a checkpoint's weights mean. How it runs (kernels, remat) is mjax.config.execution."""

import dataclasses
import math
import re

from mjax.config.base import ConfigError, field

MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
MOE_DROP_POLICIES = ("probs", "position")
MOE_ROUTER_DTYPES = ("fp32", "fp64")
MOE_GROUPED_GEMM_IMPLS = ("auto", "pallas", "mosaic", "xla")
MOE_TOKEN_DISPATCHER_TYPES = ("alltoall", "allgather")
MOE_ALLTOALL_IMPLS = ("auto", "ragged", "padded")
# Remat names of the MoE layer's intermediate results (mjax/model/moe.py), for --remat_save_names.
MOE_REMAT_NAMES = ("moe_router_logits", "moe_dispatch", "moe_up", "moe_hidden", "moe_down", "moe_out")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str = field("custom", help="Preset name, for logs.")
    num_layers: int = field(2, "num_layers")
    hidden_size: int = field(64, "hidden_size")
    num_attention_heads: int = field(4, "num_attention_heads")
    num_query_groups: int | None = field(None, "num_query_groups", "KV heads (GQA/MQA); None means MHA.")
    kv_channels: int | None = field(None, "kv_channels", "Head dim; None means hidden_size / heads.")
    ffn_hidden_size: int = field(256, "ffn_hidden_size")
    vocab_size: int = field(256, "vocab_size", "Tokenizer vocab; padded up for sharding.")
    make_vocab_size_divisible_by: int = field(128, "make_vocab_size_divisible_by")
    max_position_embeddings: int = field(2048, "max_position_embeddings")
    normalization: str = field("rmsnorm", "normalization", "rmsnorm | layernorm")
    norm_epsilon: float = field(1e-5, "norm_epsilon")
    activation: str = field("swiglu", "activation", "swiglu | gelu")
    position_embedding_type: str = field("rope", "position_embedding_type", "rope | learned")
    rotary_base: float = field(10000.0, "rotary_base")
    rope_scaling: str = field("none", "rope_scaling", "none | llama3 | yarn")
    rope_scaling_factor: float = field(8.0, "rope_scaling_factor", "Context extension factor of llama3 / yarn "
                                       "RoPE scaling (Megatron's --rotary_scaling_factor).")
    rope_low_freq_factor: float = field(1.0)
    rope_high_freq_factor: float = field(4.0)
    rope_original_max_positions: int = field(8192, help="llama3 / yarn: the context length trained before scaling.")
    # YaRN (--rope_scaling=yarn; Megatron's --beta-fast, --beta-slow, --mscale, --mscale-all-dim)
    rope_yarn_beta_fast: float = field(32.0, "beta_fast", "YaRN: rotations above which a frequency is kept.")
    rope_yarn_beta_slow: float = field(1.0, "beta_slow", "YaRN: rotations below which a frequency is interpolated.")
    rope_yarn_mscale: float = field(1.0, "mscale", "YaRN: cos/sin are scaled by m(mscale) / m(mscale_all_dim), "
                                    "m(a) = 0.1 a ln(factor) + 1.")
    rope_yarn_mscale_all_dim: float = field(0.0, "mscale_all_dim", "YaRN: the softmax scale is multiplied by "
                                            "m(mscale_all_dim)^2 (0: unchanged).")
    add_bias_linear: bool = field(False, "add_bias_linear", "Biases on every linear layer (GPT-2).")
    add_qkv_bias: bool = field(False, "add_qkv_bias", "Biases on Q, K, V only (Qwen2).")
    untie_embeddings_and_output_weights: bool = field(True, "untie_embeddings_and_output_weights")
    window_size: int | None = field(None, "window_size", "Sliding-window attention: positions each query sees, its "
                                    "own included (Mistral); None: full causal attention.")
    qk_layernorm: bool = field(False, "qk_layernorm", "Normalize queries and keys (--normalization) per head before "
                               "RoPE (Qwen3).")
    qk_layernorm_across_heads: bool = field(
        False, "qk_layernorm_across_heads", "With --qk_layernorm: one norm over all heads' features of Q and of K "
        "(OLMoE) instead of one per head.")
    init_method_std: float = field(0.02, "init_method_std")
    # Multi-head latent attention (DeepSeek-V2/V3; Megatron's names): mjax/model/mla.py.
    multi_latent_attention: bool = field(False, "multi_latent_attention", "MLA: keys and values from a compressed "
                                         "latent, RoPE on a decoupled key part shared by the heads.")
    q_lora_rank: int | None = field(None, "q_lora_rank", "MLA: rank of the query compression; None: a full-rank "
                                    "query projection (DeepSeek-V2-Lite).")
    kv_lora_rank: int = field(512, "kv_lora_rank", "MLA: rank of the compressed key/value latent.")
    qk_head_dim: int = field(128, "qk_head_dim", "MLA: the per-head query/key dims without RoPE.")
    qk_pos_emb_head_dim: int = field(64, "qk_pos_emb_head_dim", "MLA: the query/key dims with RoPE (the key's are "
                                     "shared by all heads).")
    v_head_dim: int = field(128, "v_head_dim", "MLA: the per-head value dims.")
    # Mixture of experts (Megatron's --moe-* names). num_experts=None: every layer has a dense MLP.
    num_experts: int | None = field(None, "num_experts", "Routed experts per MoE layer; None means a dense model.")
    moe_layer_freq: str = field(
        "1", "moe_layer_freq", "Which layers are MoE: an int N (every N-th layer from layer 0) or a 0/1 pattern, "
        "e.g. '[0]*1+[1]*27'.")
    moe_first_dense_layers: int = field(0, "moe_first_dense_layers",
                                         "Leading dense layers before the MoE layers (DeepSeek's first_k_dense).")
    moe_ffn_hidden_size: int | None = field(None, "moe_ffn_hidden_size", "Expert FFN size; None means ffn_hidden_size.")
    moe_shared_expert_intermediate_size: int | None = field(
        None, "moe_shared_expert_intermediate_size", "FFN size of the shared experts (all of them together).")
    moe_shared_expert_gate: bool = field(False, "moe_shared_expert_gate",
                                          "Scale the shared experts' output by sigmoid(x @ w) (Qwen2-MoE).")
    moe_router_topk: int = field(2, "moe_router_topk")
    moe_router_score_function: str = field("softmax", "moe_router_score_function", "softmax | sigmoid")
    moe_router_pre_softmax: bool = field(
        False, "moe_router_pre_softmax", "Softmax over all experts before the top-k (no renormalisation); else the "
        "top-k logits are softmaxed.")
    moe_router_num_groups: int | None = field(None, "moe_router_num_groups", "Expert groups (group-limited routing).")
    moe_router_group_topk: int | None = field(None, "moe_router_group_topk", "Groups a token may route to.")
    moe_router_group_score_topk: int | None = field(
        None, "moe_router_group_score_topk", "A group's rank is the sum of its best this many scores; None: "
        "topk / group_topk (Megatron). DeepSeek-V3's code uses 2, DeepSeek-V2's 1.")
    moe_router_topk_scaling_factor: float | None = field(None, "moe_router_topk_scaling_factor",
                                                          "Multiplies the routing weights (DeepSeek).")
    moe_router_dtype: str = field("fp32", "moe_router_dtype", "fp32 | fp64: router logits and scores.")
    moe_router_load_balancing_type: str = field(
        "aux_loss", "moe_router_load_balancing_type", "aux_loss | seq_aux_loss | global_aux_loss | none")
    moe_aux_loss_coeff: float = field(0.0, "moe_aux_loss_coeff")
    moe_z_loss_coeff: float = field(0.0, "moe_z_loss_coeff")
    moe_router_enable_expert_bias: bool = field(
        False, "moe_router_enable_expert_bias", "Aux-loss-free balancing: a per-expert bias on the top-k choice's "
        "scores, moved each step towards equal load.")
    moe_router_bias_update_rate: float = field(1e-3, "moe_router_bias_update_rate")
    moe_router_force_load_balancing: bool = field(
        False, "moe_router_force_load_balancing", "Benchmark mode: route to balanced experts, whatever the router "
        "says.")
    moe_expert_capacity_factor: float | None = field(
        None, "moe_expert_capacity_factor", "None: dropless; else each expert takes at most this factor times its "
        "even share of the routed tokens.")
    moe_token_drop_policy: str = field("probs", "moe_token_drop_policy",
                                        "probs | position: over capacity, drop the lowest-weight or the latest tokens.")
    moe_pad_expert_input_to_capacity: bool = field(False, "moe_pad_expert_input_to_capacity",
                                                    "With a capacity factor: every expert computes exactly capacity rows.")
    # Multi-token prediction (DeepSeek-V3; Megatron's names): mjax/model/mtp.py.
    mtp_num_layers: int | None = field(
        None, "mtp_num_layers", "Multi-token prediction depths after the model: depth k predicts the token k + 1 "
        "ahead with one more block of the model's last layer's kind; None or 0: off.")
    mtp_loss_scaling_factor: float = field(0.1, "mtp_loss_scaling_factor",
                                           "The objective adds this times the mean of the depths' MTP losses.")

    @property
    def num_kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def mtp_depth(self) -> int:
        """The multi-token prediction depths (0: off)."""
        return self.mtp_num_layers or 0

    def mtp_is_moe(self) -> bool:
        """Whether the MTP blocks are MoE blocks: they take the kind of the model's last layer (as Megatron)."""
        return self.moe_layer_pattern()[-1]

    def moe_layer_pattern(self) -> tuple[bool, ...]:
        """Per layer, whether it is an MoE layer: --moe_layer_freq (Megatron: an int N makes layers 0, N, 2N, ...
        MoE; a pattern such as '[0]*1+[1]*27' lists them), with the first --moe_first_dense_layers forced dense.
        All False without --num_experts."""
        if self.num_experts is None:
            return (False,) * self.num_layers
        pattern = parse_layer_freq(self.moe_layer_freq, self.num_layers)
        first = self.moe_first_dense_layers
        return tuple(False if i < first else bool(p) for i, p in enumerate(pattern))

    def padded_vocab_size(self) -> int:
        """Vocab rounded up to make_vocab_size_divisible_by. Unlike Megatron it does not depend on tp, so
        checkpoints restore onto any layout; validation requires it to be divisible by tp."""
        multiple = self.make_vocab_size_divisible_by
        return math.ceil(self.vocab_size / multiple) * multiple


def parse_layer_freq(text: str, num_layers: int) -> tuple[int, ...]:
    """--moe_layer_freq as Megatron reads it: an int N -> [1 if i % N == 0 else 0]; else a pattern of bracketed 0/1
    lists, each optionally repeated ('*n') and joined by '+', whose length must be --num_layers."""
    text = str(text).strip()
    if re.fullmatch(r"\d+", text):
        n = int(text)
        if n < 1:
            raise ConfigError(f"--moe_layer_freq={text}: an interval must be >= 1")
        return tuple(1 if i % n == 0 else 0 for i in range(num_layers))
    pattern = []
    for term in text.replace(" ", "").split("+"):
        m = re.fullmatch(r"\[([01](?:,[01])*)\](?:\*(\d+))?", term)
        if not m:
            raise ConfigError(f"--moe_layer_freq={text!r}: expected an int or a pattern like '[0]*1+[1]*27' (0 dense, "
                              "1 MoE)")
        pattern += [int(v) for v in m.group(1).split(",")] * int(m.group(2) or 1)
    if len(pattern) != num_layers:
        raise ConfigError(f"--moe_layer_freq={text!r} describes {len(pattern)} layers, but --num_layers={num_layers}")
    return tuple(pattern)
