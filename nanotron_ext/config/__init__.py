"""Typed run configuration: YAML sections as keyword-only dataclasses (see schema.py; technique packages
mount their own sections, see compose.py), loaded strictly from YAML plus `--set key=value` overrides
(see loader.py)."""
from nanotron_ext.config.loader import (  # noqa: F401
    add_config_args,
    apply_overrides,
    config_from_args,
    config_to_dict,
    config_to_yaml,
    describe,
    from_dict,
    load_config,
    save_config,
)
from nanotron_ext.config.schema import (  # noqa: F401
    CheckpointsConfig,
    CodecConfig,
    Config,
    ConfigError,
    DataConfig,
    EmbeddingConfig,
    GeneralConfig,
    LinkConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    OutputConstraintConfig,
    ParallelismConfig,
    TokenizerConfig,
    TokensConfig,
)
