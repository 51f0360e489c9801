"""megarl.config: the typed run schema, YAML + dotted-override loading, validation."""

from megarl.config.loader import ConfigError, dump, from_dict, load_config, to_dict
from megarl.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    BridgeConfig,
    ClusterConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    TrainerConfig,
)
from megarl.config.validate import data_parallel_size, validate

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "BridgeConfig",
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RefConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainerConfig",
    "data_parallel_size",
    "dump",
    "from_dict",
    "load_config",
    "to_dict",
    "validate",
]
