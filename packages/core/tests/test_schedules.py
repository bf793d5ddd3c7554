"""Schedules are orders of microbatch phases; the driver checks any order it gets."""

from __future__ import annotations

import pytest

from disagg.builtin.schedules import EncodersAhead, Sequential
from disagg.interfaces.schedule import Op, check_order
from disagg.plugins import get_registry


def _inflight_peak(ops: list[Op]) -> int:
    live = peak = 0
    for op in ops:
        live += {"forward": 1, "backward": -1}.get(op.phase, 0)
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("n", [1, 2, 4, 7])
@pytest.mark.parametrize("inflight", [1, 2, 3])
def test_builtin_orders_are_valid_and_bounded(n, inflight):
    for sched in (Sequential(), EncodersAhead()):
        for frozen in (False, True):
            ops = sched.order(n, max_inflight=inflight, frozen=frozen)
            check_order(ops, n, max_inflight=inflight, frozen=frozen, name=sched.name)
    assert _inflight_peak(Sequential().order(n, max_inflight=inflight, frozen=False)) == 1
    assert _inflight_peak(EncodersAhead().order(n, max_inflight=inflight, frozen=False)) == min(n, inflight)


def test_encoders_ahead_runs_the_next_forward_before_the_llm_needs_it():
    ops = EncodersAhead().order(4, max_inflight=2, frozen=False)
    assert ops.index(Op("forward", 1)) < ops.index(Op("llm", 0))
    # a frozen encoder keeps no activations and runs fully ahead
    frozen = EncodersAhead().order(4, max_inflight=2, frozen=True)
    assert [op.phase for op in frozen] == ["forward"] * 4 + ["llm"] * 4


@pytest.mark.parametrize(
    "ops,needle",
    [
        ([Op("llm", 0), Op("forward", 0), Op("backward", 0)], "llm 0 before forward 0"),
        ([Op("forward", 0), Op("llm", 0)], "once per microbatch"),
        (
            [
                Op("forward", 0),
                Op("forward", 1),
                Op("llm", 0),
                Op("llm", 1),
                Op("backward", 0),
                Op("backward", 1),
            ],
            "max_inflight=1",
        ),
    ],
)
def test_bad_orders_are_refused_by_name(ops, needle):
    with pytest.raises(ValueError, match="schedule 'mine'") as err:
        check_order(ops, 2 if len(ops) == 6 else 1, max_inflight=1, frozen=False, name="mine")
    assert needle in str(err.value)


def test_schedules_are_registered_like_plugins():
    reg = get_registry()
    assert {"sequential", "encoders_ahead"} <= set(reg.schedules)
    assert "schedules" in reg.plugins["disagg.builtin"].registered


def test_a_plugin_schedule_is_registered_through_the_hook(disagg_registry):
    import disagg
    from disagg.plugins import register_plugin

    class Reversed(Sequential):
        """A third-party order: whole microbatches, last first."""

        name = "reversed"

        def order(self, n, *, max_inflight, frozen):
            one = Sequential().order(1, max_inflight=1, frozen=frozen)
            return [Op(op.phase, mb) for mb in reversed(range(n)) for op in one]

    class Plugin:
        @staticmethod
        @disagg.hookimpl
        def disagg_register_schedules(register):
            register(Reversed)

    reg = register_plugin(Plugin, name="mine")
    assert reg.schedules["reversed"] is Reversed and "schedules" in reg.plugins["mine"].registered
    ops = reg.schedules["reversed"]().order(3, max_inflight=1, frozen=False)
    check_order(ops, 3, max_inflight=1, frozen=False, name="reversed")
    assert ops[0] == Op("forward", 2)
