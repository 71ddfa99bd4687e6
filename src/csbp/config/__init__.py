"""Typed YAML run configuration: the schema, loading with ``--set`` overrides, and dumping.

Usage::

    from csbp.config import load_config, dump_config
    cfg = load_config("run.yaml", ["optim.lr=3e-4"])
    print(cfg.topology.cp, cfg.objective.block_size)
"""

from csbp.config.loading import (
    ConfigError,
    apply_overrides,
    config_from_dict,
    dump_config,
    load_config,
    parse_overrides,
    write_config,
)
from csbp.config.schema import (
    ConfigRuleError,
    DataSection,
    DFlashSection,
    ModelSection,
    ObjectiveSection,
    OptimSection,
    RunConfig,
    RunSection,
    TopologySection,
    TrainSection,
)

__all__ = [
    "ConfigError",
    "ConfigRuleError",
    "DFlashSection",
    "DataSection",
    "ModelSection",
    "ObjectiveSection",
    "OptimSection",
    "RunConfig",
    "RunSection",
    "TopologySection",
    "TrainSection",
    "apply_overrides",
    "config_from_dict",
    "dump_config",
    "load_config",
    "parse_overrides",
    "write_config",
]
