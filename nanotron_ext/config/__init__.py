"""Typed run configuration: YAML sections as keyword-only dataclasses (see schema.py)."""
from nanotron_ext.config.schema import (  # noqa: F401
    BoostConfig,
    CheckpointsConfig,
    CodecConfig,
    Config,
    ConfigError,
    DataConfig,
    GeneralConfig,
    LinkConfig,
    LoggingConfig,
    LowRankConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    TokenizerConfig,
    TokensConfig,
)
