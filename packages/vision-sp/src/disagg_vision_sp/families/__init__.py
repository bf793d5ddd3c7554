"""Vision families: ``qwen2_5_vl`` (Qwen2.5-VL visual tower) and ``llava`` (SigLIP + MLP projector)."""
