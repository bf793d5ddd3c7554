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
    #: ``parallel.<m>.context_parallel`` (1 without a sequence split)
    context_parallel: int = 1

    @property
    def size(self) -> int:
        """Ranks of the group: ``degree * context_parallel * replicas``."""
        return self.degree * self.context_parallel * self.replicas


#: only :func:`disagg.config.validate.validate` holds this: it alone makes a :class:`ResolvedConfig`
_VALIDATION = object()


@dataclass
class ResolvedConfig:
    """A config that passed every actor-free check, plugins resolved.

    Only :func:`disagg.config.validate.validate` makes one, so a function that
    takes a ``ResolvedConfig`` (``run_training``, ``make_plan``, bench) knows the
    config was validated and checks nothing twice."""

    config: Config
    modules: dict[str, ResolvedModule] = field(default_factory=dict)
    transport: str = "auto"
    issued_by: object = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.issued_by is not _VALIDATION:
            raise TypeError("a ResolvedConfig comes only from disagg.config.validate.validate(cfg, registry)")


def require_resolved(cfg: object, what: str) -> ResolvedConfig:
    """``cfg`` itself when validation made it; else a :class:`TypeError` saying to validate first."""
    if not isinstance(cfg, ResolvedConfig):
        raise TypeError(
            f"{what} takes the validated config that disagg.config.validate.validate(cfg, registry) "
            f"returns, not a {type(cfg).__name__}: validate it first"
        )
    return cfg


def reserved_cpus(resolved: ResolvedConfig) -> float:
    """Logical CPUs the training ranks reserve: degree x context_parallel x replicas x
    ``resources.num_cpus`` per module."""
    return sum(
        m.size * getattr(resolved.config.parallel, name).resources.num_cpus
        for name, m in resolved.modules.items()
    )


def role_of(module: str) -> str:
    return "llm" if module == "llm" else "encoder"
