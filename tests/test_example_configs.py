"""The real-model configs under ``examples/configs/`` pass the validation
``disagg train`` runs before any actor starts, against the real models' shapes,
with no weights and no network.

Their model ids are resolved as in a real run, through the hub cache
(``HF_HUB_OFFLINE=1``, ``HF_HOME`` in tmp), which holds only each model's
``config.json`` as published on the Hub: validation reads configs, never
weights, and an offline cache with just ``config.json`` is all it needs (a user
can check a config the same way after ``hf download ID config.json``). An id
missing from the cache is a config error there as everywhere (no
"validation-only" mode skips it; ``test_model_ids.py``). Only the dataset is a
stand-in: a small LLaVA-format file in place of the user's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))

_TOKENS = {
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
}
_VISION = {
    "depth": 32,
    "hidden_act": "silu",
    "hidden_size": 1280,
    "num_heads": 16,
    "in_chans": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "spatial_patch_size": 14,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "tokens_per_second": 2,
    "temporal_patch_size": 2,
}
_TEXT = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 128000,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "sliding_window": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 152064,
    **_TOKENS,
}
#: the published config.json of each id (values as on the Hub; no weights)
HUB_CONFIGS = {
    "Qwen/Qwen2.5-VL-7B-Instruct": {
        **_TEXT,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "max_window_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vision_config": {**_VISION, "intermediate_size": 3420, "out_hidden_size": 3584},
    },
    "Qwen/Qwen2.5-VL-32B-Instruct": {
        **_TEXT,
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "num_hidden_layers": 64,
        "max_window_layers": 64,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "vision_config": {**_VISION, "intermediate_size": 3456, "out_hidden_size": 5120},
    },
}


@pytest.fixture(scope="module")
def offline_hub(tmp_path_factory):
    """An HF_HOME holding each id's config.json only, and a 3-row LLaVA dataset."""
    import huggingface_hub.constants as constants
    from PIL import Image

    from disagg.testing.hub import populate_hub_cache

    root = tmp_path_factory.mktemp("hub")
    snapshots = {}
    for repo, config in HUB_CONFIGS.items():
        src = root / "src" / repo
        src.mkdir(parents=True)
        (src / "config.json").write_text(json.dumps(config, indent=2))
        snapshots[repo] = populate_hub_cache(root / "hf" / "hub", repo, src)
    media = root / "data"
    (media / "coco").mkdir(parents=True)
    rows = []
    for i, size in enumerate([(640, 480), (336, 336), (1024, 768)]):
        Image.new("RGB", size, (40 * i, 90, 160)).save(media / "coco" / f"{i}.jpg")
        rows.append(
            {
                "id": str(i),
                "image": f"coco/{i}.jpg",
                "conversations": [
                    {"from": "human", "value": "<image>\nWhat is in the picture?"},
                    {"from": "gpt", "value": "A plain colored rectangle."},
                ],
            }
        )
    (media / "train.json").write_text(json.dumps(rows))
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HOME", str(root / "hf"))
    mp.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub read the environment when imported: its constants say what the env now says
    mp.setattr(constants, "HF_HUB_CACHE", str(root / "hf" / "hub"))
    mp.setattr(constants, "HF_HUB_OFFLINE", True)
    yield snapshots, media
    mp.undo()


def test_there_are_real_model_examples():
    names = {p.name for p in CONFIGS}
    assert {"qwen2_5_vl_7b_8gpu_llava.yaml", "qwen2_5_vl_32b_8gpu_llava.yaml"} <= names, names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_example_config_validates_against_the_real_model(path, offline_hub):
    from disagg.config import load_config_and_source
    from disagg.config.devices import gpu_share_problems
    from disagg.config.validate import validate
    from disagg.plugins import get_registry

    snapshots, media = offline_hub
    overrides = [f"data.train={media / 'train.json'}", f"data.media_root={media}"]
    cfg, source = load_config_and_source(path, overrides)
    assert cfg.data.format == "llava"
    ids = {getattr(cfg.model, m).path for m in cfg.modules()}
    assert ids <= set(HUB_CONFIGS), ids  # the examples name real Hub ids
    resolved = validate(cfg, get_registry(), source=source)
    for m in cfg.modules():
        assert resolved.config.model.__getattribute__(m).path == str(snapshots[getattr(cfg.model, m).path])
    # 8 GPUs: every rank of the layout fits on one 8-GPU node under the CUDA shares
    ranks = [resolved.modules[m].degree * resolved.modules[m].replicas for m in resolved.modules]
    placement = resolved.config.parallel.placement
    assert (max(ranks) if placement == "collocated" else sum(ranks)) == 8, (placement, ranks)
    assert gpu_share_problems(resolved.config, "cuda") == []


def test_validation_reads_the_real_shapes(offline_hub):
    """The cached config.json is what is checked: TP 8 cannot split the 7B's 4 KV heads."""
    from disagg.config import ConfigError, load_config_and_source
    from disagg.config.validate import validate
    from disagg.plugins import get_registry

    _, media = offline_hub
    path = ROOT / "examples" / "configs" / "qwen2_5_vl_7b_8gpu_llava.yaml"
    overrides = [f"data.train={media / 'train.json'}", f"data.media_root={media}", "parallel.llm.degree=8"]
    cfg, source = load_config_and_source(path, overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg, get_registry(), source=source)
    assert "parallel.llm" in str(err.value) and "28 attention heads" in str(err.value), err.value
