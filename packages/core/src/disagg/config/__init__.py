"""Run configuration: the schema, loading from YAML, validation against the plugins."""

from disagg.config.errors import ConfigError, Problem
from disagg.config.load import load_config, load_config_and_source
from disagg.config.schema import Config
from disagg.config.source import SourceMap

__all__ = ["Config", "ConfigError", "Problem", "SourceMap", "load_config", "load_config_and_source"]
