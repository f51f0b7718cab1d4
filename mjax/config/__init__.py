"""Run configuration: typed sections, presets, flags and validation (no JAX is imported here)."""

from mjax.config.base import ConfigError
from mjax.config.execution import ExecutionConfig
from mjax.config.load import PRESETS, configs_dir, load_config, preset_names
from mjax.config.model import ModelConfig
from mjax.config.sections import (SECTIONS, CheckpointConfig, Config, DataConfig, LoggingConfig, OptimizerConfig,
                                  ParallelConfig, PrecisionConfig, TrainConfig, from_dict)

__all__ = [
    "PRESETS", "SECTIONS", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "ExecutionConfig",
    "LoggingConfig", "ModelConfig",
    "OptimizerConfig", "ParallelConfig", "PrecisionConfig", "TrainConfig", "configs_dir", "from_dict",
    "load_config", "preset_names",
]
