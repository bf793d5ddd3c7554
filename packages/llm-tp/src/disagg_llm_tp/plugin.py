"""Entry point (group ``disagg``): registers ``megatron_tp`` and the LLM families."""

from __future__ import annotations

from typing import Callable

from disagg import hookimpl


@hookimpl
def disagg_register_strategies(register: Callable[[type], None]) -> None:
    from disagg_llm_tp.strategy import MegatronTPStrategy

    register(MegatronTPStrategy)


@hookimpl
def disagg_register_families(register: Callable[[type], None]) -> None:
    from disagg_llm_tp.families.internvl import InternVLLanguageFamily
    from disagg_llm_tp.families.llama import LlamaFamily
    from disagg_llm_tp.families.qwen2 import Qwen2Family
    from disagg_llm_tp.families.qwen2_5_omni import Qwen25OmniLanguageFamily
    from disagg_llm_tp.families.qwen2_5_vl import Qwen25VLLanguageFamily
    from disagg_llm_tp.families.qwen2_audio import Qwen2AudioLanguageFamily
    from disagg_llm_tp.families.qwen2_vl import Qwen2VLLanguageFamily
    from disagg_llm_tp.families.qwen3_5 import Qwen35LanguageFamily
    from disagg_llm_tp.families.qwen3_vl import Qwen3VLLanguageFamily

    register(Qwen2Family)
    register(LlamaFamily)
    register(Qwen25VLLanguageFamily)
    register(Qwen2AudioLanguageFamily)
    register(Qwen2VLLanguageFamily)
    register(Qwen3VLLanguageFamily)
    register(Qwen25OmniLanguageFamily)
    register(Qwen35LanguageFamily)
    register(InternVLLanguageFamily)
