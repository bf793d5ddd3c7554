"""Evaluation during training on a tiny Qwen2.5-VL, end to end through ``run_training``.

The train set is one global batch of real-shaped data (a large image, a
two-image sample of different sizes, two text-only samples), read in file
order, and the eval set is the same file: the eval loss after step k
(weights after k updates, eval mode) must be the train loss of step k+1
(the same weights, train mode, before update k+1). The tiny model has no
dropout, so the two modes compute the same function; any difference is a
routing, normalisation or mode bug in evaluation.

The layout is the paper's DHP (ulysses vision with two uneven replicas: a
microbatch has one image for two replicas; megatron_tp LLM) under the
``encoders_ahead`` schedule. The same for ddp is in core's
``test_eval_trackers``; evaluation under ZeRO-3, ZeRO-2 + TP and
``encoders_ahead`` with four microbatches equals the HF model's eval loss in
``test_e2e_mixes``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagg.config.validate import validate
from disagg.plugins import get_registry

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")

from mixed_data import mixed_config, write_mixed_data  # noqa: E402

FAMILY = "qwen2_5_vl"
STEPS = 3

#: the paper's DHP, with two vision replicas that a microbatch's one image leaves uneven
VISION = {"strategy": "ulysses", "degree": 2, "replicas": 2}
LLM = {"strategy": "megatron_tp", "degree": 2}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from disagg.cli.make_tiny import make_tiny

    out = tmp_path_factory.mktemp("tiny")
    manifest = make_tiny(out, [FAMILY], data=False)
    rows = write_mixed_data(out / "data").read_text().splitlines()
    one_batch = out / "data" / "one_batch.jsonl"
    one_batch.write_text("\n".join(rows[:4]) + "\n")  # large image, text, two images, text
    manifest["train"] = manifest["eval"] = str(one_batch)
    manifest["media_root"] = str(out / "data")
    return manifest


def test_dhp_eval_loss_after_step_k_is_train_loss_of_step_k_plus_1(ray_local, tiny, tmp_path):
    from transformers import AutoConfig

    from disagg.runtime.run import run_training

    hf = AutoConfig.from_pretrained(tiny["models"][FAMILY])
    assert (
        hf.text_config.attention_dropout == 0 and hf.vision_config.to_dict().get("attention_dropout", 0) == 0
    )
    model = {m: {"family": FAMILY, "path": tiny["models"][FAMILY]} for m in ("vision", "llm")}
    cfg = mixed_config(
        model,
        {"vision": VISION, "llm": LLM},
        tiny,
        tmp_path / "run",
        STEPS,
        eval_every=1,
        schedule="encoders_ahead",
        max_inflight=2,
    )
    summary = run_training(validate(cfg, get_registry()), progress=False)
    rows = [json.loads(x) for x in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all("eval_loss" in r for r in rows)
    for k in range(STEPS - 1):
        assert rows[k]["eval_loss"] == pytest.approx(rows[k + 1]["loss"], rel=1e-6, abs=0), (k, rows)
    first = rows[0]
    assert first["eval_label_tokens"] == first["label_tokens"] and first["eval_samples"] == 4
    # per-module tokens: the vision placeholders of three images, the LLM's whole sequences
    assert first["eval_module_tokens"] == first["module_tokens"]
    assert first["module_tokens"]["llm"] == first["tokens"] and first["module_tokens"]["vision"] > 0
    assert summary["eval_loss"] == rows[-1]["eval_loss"] < first["loss"]
