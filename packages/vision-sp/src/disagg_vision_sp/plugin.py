"""Entry point (group ``disagg``): registers ``ulysses`` and the vision families."""

from __future__ import annotations

from typing import Callable

from disagg import hookimpl


@hookimpl
def disagg_register_strategies(register: Callable[[type], None]) -> None:
    from disagg_vision_sp.ulysses.strategy import UlyssesStrategy

    register(UlyssesStrategy)


@hookimpl
def disagg_register_families(register: Callable[[type], None]) -> None:
    from disagg_vision_sp.families.internvl import InternVLVision
    from disagg_vision_sp.families.llava import LlavaVision
    from disagg_vision_sp.families.qwen2_5_omni import Qwen2_5OmniVision
    from disagg_vision_sp.families.qwen2_5_vl import Qwen2_5_VLVision
    from disagg_vision_sp.families.qwen2_vl import Qwen2VLVision
    from disagg_vision_sp.families.qwen3_5 import Qwen3_5Vision
    from disagg_vision_sp.families.qwen3_vl import Qwen3VLVision

    register(Qwen2_5_VLVision)
    register(LlavaVision)
    register(Qwen2VLVision)
    register(Qwen3VLVision)
    register(Qwen2_5OmniVision)
    register(Qwen3_5Vision)
    register(InternVLVision)
