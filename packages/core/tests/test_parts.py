"""Partial freezing and per-part param groups, as a strategy applies them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from disagg.builtin.ddp import DDPStrategy
from disagg.interfaces import OptimSpec, PartGroup
from disagg.kit.parts import freeze_parts, optimizer_groups
from disagg.testing import ranks


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tower = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.tower(x))


def _strategy(optim: OptimSpec) -> DDPStrategy:
    ctx = ranks.rank_context("vision", 0, 1, 1)
    torch.manual_seed(0)
    return ranks.strategy_rank(DDPStrategy, None, ctx, optim=optim, module=Tiny())  # type: ignore[arg-type,return-value]


def test_frozen_part_gets_no_grad_and_no_state_and_groups_get_their_lr():
    optim = OptimSpec(
        lr=1e-3,
        weight_decay=0.1,
        frozen=(("tower", ("tower.*",)),),
        groups=(PartGroup("head", ("head.*",), lr=5e-3, weight_decay=0.0),),
    )
    s = _strategy(optim)
    before = {k: v.clone() for k, v in s.module.state_dict().items()}
    s.module(torch.randn(5, 3)).sum().backward()
    assert all(p.grad is None for p in s.module.tower.parameters())
    s.step(1.0)
    after = s.module.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before if k.startswith("tower."))
    assert all(not torch.equal(after[k], before[k]) for k in before if k.startswith("head."))
    held = {id(p) for p in s.optimizer.state}
    assert held == {id(p) for p in s.module.head.parameters()}
    (group,) = s.optimizer.param_groups  # every trainable parameter is in the head's group
    assert group["lr"] == 5e-3 and group["weight_decay"] == 0.0


def test_unnamed_parameters_keep_the_module_settings():
    optim = OptimSpec(lr=1e-3, weight_decay=0.1, groups=(PartGroup("head", ("head.*",), 5e-3, 0.0),))
    s = _strategy(optim)
    rest, head = s.optimizer.param_groups
    assert (rest["lr"], rest["weight_decay"], len(rest["params"])) == (1e-3, 0.1, 4)
    assert (head["lr"], len(head["params"])) == (5e-3, 2)


def test_a_part_matching_nothing_is_an_error():
    with pytest.raises(ValueError, match=r"train.modules.vision.freeze: part 'neck' \(neck.\*\) matches no"):
        freeze_parts(Tiny(), {"neck": ("neck.*",)}, "train.modules.vision")
    m = Tiny()
    m.head.requires_grad_(False)
    trainable = [p for p in m.parameters() if p.requires_grad]
    with pytest.raises(ValueError, match="param_groups: part 'head'"):
        optimizer_groups(m, trainable, (PartGroup("head", ("head.*",), 1e-3, 0.0),), "train.modules.x")


def test_a_tied_weight_answers_to_both_names():
    m = Tiny()
    m.extra = nn.Linear(4, 2)
    m.extra.weight = m.head.weight  # tied, like lm_head and embed_tokens
    freeze_parts(m, {"extra": ("extra.*",)}, "train.modules.llm")
    assert not m.head.weight.requires_grad
