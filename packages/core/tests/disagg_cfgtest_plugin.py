"""A tiny test-only plugin for the config/CLI tests: one encoder family, one
LLM family and one sharded strategy with an option, none of which ever runs.

Its family ``check`` reports a divisibility problem like real families do, so
that tests can see family checks surface before any actor starts.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch
from pydantic import PositiveInt
from torch import nn

import disagg
from disagg.interfaces import EncoderFamily, LanguageFamily, StrategyOptions
from disagg.kit import Strategy

HEADS = 4


def _heads_check(degree: int) -> list[str]:
    if HEADS % degree:
        divisors = ", ".join(str(d) for d in range(1, HEADS + 1) if HEADS % d == 0)
        return [
            f"{HEADS} attention heads are not divisible by degree {degree}; "
            f"use a divisor of {HEADS}: {divisors}"
        ]
    return []


class CfgEncoder(EncoderFamily):
    name: ClassVar[str] = "cfgtest"
    modality: ClassVar[str] = "image"

    def check(self, strategy: str, degree: int, replicas: int) -> list[str]:
        return _heads_check(degree)

    def build(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        return nn.Linear(2, 2)

    def export_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state

    def preprocess(self, media: list[Any]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def num_tokens(self, inputs: dict[str, torch.Tensor]) -> list[int]:
        raise NotImplementedError

    def encode(self, module: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError


class CfgLLM(LanguageFamily):
    name: ClassVar[str] = "cfgtest"

    def check(self, strategy: str, degree: int, replicas: int) -> list[str]:
        return _heads_check(degree)

    def build(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        return nn.Linear(2, 2)

    def export_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state

    def placeholder_token_id(self, module: str) -> int:
        return 0

    def forward(self, module, inputs, embeds):  # type: ignore[no-untyped-def]
        raise NotImplementedError


class ShardOptions(StrategyOptions):
    chunks: PositiveInt = 1


class ShardStrategy(Strategy):
    name: ClassVar[str] = "cfgtest_sp"
    options_model: ClassVar[type[StrategyOptions]] = ShardOptions

    def parallelize(self, module: nn.Module) -> nn.Module:
        return module


@disagg.hookimpl
def disagg_register_families(register: Callable[[type], None]) -> None:
    register(CfgEncoder)
    register(CfgLLM)


@disagg.hookimpl
def disagg_register_strategies(register: Callable[[type], None]) -> None:
    register(ShardStrategy)
