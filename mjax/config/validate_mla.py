"""Checks of --multi_latent_attention's sizes and of YaRN RoPE scaling (mjax/model/mla.py, mjax/model/rope.py)."""

from mjax.config.base import ConfigError


def _positive(value, flag):
    if value is None or value <= 0:
        raise ConfigError(f"--{flag} must be a positive number, got {value}")


def validate_mla(m) -> None:
    if m.rope_scaling == "yarn":
        if not m.multi_latent_attention:
            raise ConfigError("--rope_scaling=yarn needs --multi_latent_attention: YaRN's attention factors are "
                              "applied by multi-latent attention only")
        _positive(m.rope_scaling_factor, "rope_scaling_factor")
        _positive(m.rope_original_max_positions, "model.rope_original_max_positions")
        if not 0 < m.rope_yarn_beta_slow < m.rope_yarn_beta_fast:
            raise ConfigError(f"YaRN needs 0 < --beta_slow < --beta_fast, got --beta_slow={m.rope_yarn_beta_slow} "
                              f"--beta_fast={m.rope_yarn_beta_fast}")
    if not m.multi_latent_attention:
        return
    for flag in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        _positive(getattr(m, flag), flag)
    if m.q_lora_rank is not None:
        _positive(m.q_lora_rank, "q_lora_rank")
    if m.qk_pos_emb_head_dim % 2:
        raise ConfigError(f"--qk_pos_emb_head_dim={m.qk_pos_emb_head_dim}: RoPE rotates pairs of dims, so it must "
                          "be even")
    qk = m.qk_head_dim + m.qk_pos_emb_head_dim
    if m.v_head_dim > qk:
        raise ConfigError(f"--v_head_dim={m.v_head_dim} exceeds --qk_head_dim + --qk_pos_emb_head_dim = {qk}: the "
                          "attention kernels take V zero-padded to the query/key head dim, never wider")
    if m.position_embedding_type != "rope":
        raise ConfigError("--multi_latent_attention needs --position_embedding_type=rope (its decoupled key is the "
                          "RoPE part)")
    conflicts = {"num_query_groups": m.num_query_groups not in (None, m.num_attention_heads),
                 "kv_channels": m.kv_channels is not None, "add_qkv_bias": m.add_qkv_bias,
                 "add_bias_linear": m.add_bias_linear, "qk_layernorm": m.qk_layernorm}
    for flag, bad in conflicts.items():
        if bad:
            raise ConfigError(f"--{flag}={getattr(m, flag)} has no meaning with --multi_latent_attention (its heads "
                              "and head dims are --num_attention_heads, --qk_head_dim, --qk_pos_emb_head_dim, "
                              "--v_head_dim; no biases, no Q/K norms); unset it")
