"""What validation hands the runtime: the config with each module's plugins looked up."""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.config.schema import Config
from disagg.interfaces import Family, StrategyOptions
from disagg.kit import Strategy


@dataclass
class ResolvedModule:
    """One configured module with its plugins looked up."""

    name: str
    role: str
    strategy: type[Strategy]
    options: StrategyOptions
    family: Family
    degree: int
    replicas: int


@dataclass
class ResolvedConfig:
    """A config that passed every actor-free check, plugins resolved."""

    config: Config
    modules: dict[str, ResolvedModule] = field(default_factory=dict)
    transport: str = "auto"


def reserved_cpus(resolved: ResolvedConfig) -> float:
    """Logical CPUs the training ranks reserve: degree x replicas x
    ``resources.num_cpus`` per module."""
    return sum(
        m.degree * m.replicas * getattr(resolved.config.parallel, name).resources.num_cpus
        for name, m in resolved.modules.items()
    )


def role_of(module: str) -> str:
    return "llm" if module == "llm" else "encoder"
