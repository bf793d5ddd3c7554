import sys
from pathlib import Path

import pytest

# Spawned ranks import tp_cases by name.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, str]:
    """Tiny HF dirs built offline: vocab sizes 498 / 391 / 394 are not multiples
    of 4 (498, 394) or of 2 (391), so vocabulary padding is always exercised."""
    from disagg_llm_tp.families.llama import LlamaFamily
    from disagg_llm_tp.families.qwen2 import Qwen2Family
    from disagg_llm_tp.families.qwen2_5_vl import Qwen25VLLanguageFamily
    from disagg_llm_tp.families.qwen2_vl import Qwen2VLLanguageFamily
    from disagg_llm_tp.families.qwen3_vl import Qwen3VLLanguageFamily

    root = tmp_path_factory.mktemp("tiny")
    return {
        "qwen2": str(Qwen2Family.make_tiny(root / "qwen2", vocab_size=498, tie_word_embeddings=True)),
        "qwen2_untied": str(Qwen2Family.make_tiny(root / "qwen2_untied", tie_word_embeddings=False, seed=1)),
        "llama": str(LlamaFamily.make_tiny(root / "llama")),
        "qwen2_5_vl": str(Qwen25VLLanguageFamily.make_tiny(root / "qwen2_5_vl")),
        "qwen2_vl": str(Qwen2VLLanguageFamily.make_tiny(root / "qwen2_vl")),
        "qwen3_vl": str(Qwen3VLLanguageFamily.make_tiny(root / "qwen3_vl")),
    }
