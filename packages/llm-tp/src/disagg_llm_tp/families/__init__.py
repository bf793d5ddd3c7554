"""Language-model families: ``qwen2``, ``llama``, ``qwen2_5_vl``."""
