"""Checks of --mtp_num_layers and --mtp_loss_scaling_factor (multi-token prediction: mjax/model/mtp.py)."""

from mjax.config.base import ConfigError
from mjax.config.pipeline_layout import stage_layout


def validate_mtp(cfg) -> None:
    m, p = cfg.model, cfg.parallel
    if m.mtp_num_layers is not None and m.mtp_num_layers < 0:
        raise ConfigError(f"--mtp_num_layers={m.mtp_num_layers} must be >= 0 (0 or unset: no multi-token prediction)")
    if m.mtp_loss_scaling_factor < 0:
        raise ConfigError(f"--mtp_loss_scaling_factor={m.mtp_loss_scaling_factor} must be >= 0")
    depth = m.mtp_depth
    if p.pipeline_model_parallel_layout is not None and stage_layout(p, m.num_layers).mtp != depth:
        raise ConfigError(f"--pipeline_model_parallel_layout={p.pipeline_model_parallel_layout!r} places "
                          f"{stage_layout(p, m.num_layers).mtp} multi-token-prediction depths (m), and "
                          f"--mtp_num_layers={m.mtp_num_layers}; make them agree (as Megatron does)")
    if not depth:
        return
    seq = cfg.train.seq_length
    if seq <= depth:
        raise ConfigError(f"--mtp_num_layers={depth} needs --seq_length > {depth}: depth k predicts the token k + 1 "
                          f"positions ahead, and --seq_length={seq} leaves the last depth no position to predict")
