"""Per-rank host memory of ``zero``'s set-up, measured in the rank process itself.

Peak resident memory (``VmHWM`` of ``/proc/self/status``, file-backed pages of the
mapped checkpoint included) is reset just before the build (``/proc/self/clear_refs``
``5``), so each figure is the set-up's own peak above what the process held before it
(Python, torch, DeepSpeed, the process group)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch

from disagg.testing import ranks
from disagg.testing.toy import ToyLMFamily


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> int:
    """Resident bytes now, with the high-water mark reset to them (Linux >= 4.0)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def rank_build_memory(rank: int, warm_dir: Path, lm_dir: Path, world: int) -> dict[str, Any]:
    """Peak bytes above the pre-build resident set, per phase (``build``: the module
    exists; ``setup``: then ``deepspeed.initialize``, frozen, so parameters only), for
    ZeRO-3 set up the old way (the family's whole module, partitioned by
    ``deepspeed.initialize``) and the new (``build_module``: partitioned at
    construction, own slices read); and the new build's full weights, to compare with
    the family's."""
    from disagg_zero import ZeroStrategy
    from disagg_zero.build import LAST_LOAD

    def strategy(fam: ToyLMFamily) -> Any:
        ctx = ranks.rank_context("llm", rank, 1, world)
        return ZeroStrategy(ctx, fam, ZeroStrategy.options_model(stage=3))

    # imports and JIT builds of everything both measured set-ups use, on a tiny module
    warm = strategy(ToyLMFamily(warm_dir))
    warm.setup(warm.build_module(), None)
    del warm
    fam = ToyLMFamily(lm_dir)
    out: dict[str, Any] = {}
    for label in ("whole", "partitioned"):
        LAST_LOAD.clear()
        base = _reset_peak()
        strat = strategy(fam)
        module = fam.build(torch.float32) if label == "whole" else strat.build_module()
        built = _status("VmHWM") - base
        strat.setup(module, None)
        out[label] = {"build": built, "setup": _status("VmHWM") - base, "load": LAST_LOAD.get("path")}
        if label == "partitioned":
            out["weights"] = strat.full_state_dict()
            with strat.module_call():  # what a call holds whole on top of the partitions
                out["gathered"] = sum(
                    p.data.untyped_storage().nbytes()
                    for p in strat.module.parameters()
                    if hasattr(p, "ds_tensor") and not p.ds_persist
                )
            out["numels"] = [int(p.ds_numel) for p in strat.module.parameters()]
        del strat, module
    out["module_bytes"] = sum(p.numel() * p.element_size() for p in fam.build(torch.float32).parameters())
    return out
