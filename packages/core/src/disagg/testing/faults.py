"""Strategies that break the rules on purpose, for tests of failure handling.

Importable (unlike a test module) so Ray actors can unpickle them.
"""

from __future__ import annotations

from typing import ClassVar

from disagg.builtin.ddp import DDPStrategy


class SkipsCollective(DDPStrategy):
    """``ddp`` whose last rank skips the gradient reduction: its peers wait in
    a collective it never joins, as a buggy strategy's ranks would."""

    name: ClassVar[str] = "skips_collective"

    def reduce_gradients(self) -> None:
        if self.ctx.rank == self.ctx.world_size - 1:
            return
        super().reduce_gradients()
