"""End to end on a tiny LLaVA dir (SigLIP tower + Llama decoder): the language
model runs through the `llama` family under Megatron TP with sequence
parallelism, the tower under Ulysses, and the run has the loss trajectory and
final weights of the all-`ddp` run, whose first loss is the single-process
`LlavaForConditionalGeneration`'s."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")

from e2e_run import DDP, e2e_config, train  # noqa: E402

from disagg.plugins import get_registry  # noqa: E402
from disagg.testing.reference import assert_close_dicts  # noqa: E402

STEPS = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from disagg.cli.make_tiny import make_tiny

    out = tmp_path_factory.mktemp("tiny")
    return make_tiny(out, ["llava"], train_per_class=1, eval_per_class=1, image_size=56)


def _config(tiny, out: Path, vision: dict, llm: dict):
    families = {"vision": ("llava", "llava"), "llm": ("llama", "llava")}
    return e2e_config(tiny, out, families, {"vision": vision, "llm": llm}, STEPS)


def _train(tiny, out: Path, vision: dict, llm: dict):
    return train(_config(tiny, out, vision, llm))


@pytest.fixture(scope="module")
def all_ddp(ray_local, tiny, tmp_path_factory):
    return _train(tiny, tmp_path_factory.mktemp("ddp"), DDP, DDP)


def test_ulysses_and_tp_with_sequence_parallel_equal_all_ddp(ray_local, tiny, all_ddp, tmp_path):
    got = _train(
        tiny,
        tmp_path / "run",
        {"strategy": "ulysses", "degree": 2, "replicas": 1},
        {"strategy": "megatron_tp", "degree": 2, "replicas": 1, "sequence_parallel": True},
    )
    assert got[0] == pytest.approx(all_ddp[0], rel=1e-5), (got[0], all_ddp[0])
    for m in ("vision", "llm"):
        want = all_ddp[1][m]
        assert set(got[1][m]) == set(want), m
        # SigLIP's key bias gets an exactly zero gradient (softmax ignores a shift
        # shared by all keys, and there is no RoPE), so it only moves by fp32
        # rounding noise (~1e-10): it is checked against an absolute bound.
        noise = {k for k in want if k.endswith("self_attn.k_proj.bias") and m == "vision"}
        rest = {k: v for k, v in want.items() if k not in noise}
        assert_close_dicts({k: got[1][m][k] for k in rest}, rest, what=f"{m} after {STEPS} steps: ")
        for k in noise:
            assert float((got[1][m][k] - want[k]).abs().max()) <= 1e-6, k


def test_all_ddp_first_step_equals_hugging_face_llava(ray_local, tiny, all_ddp, tmp_path):
    import ray
    from transformers import LlavaForConditionalGeneration

    from disagg.data import build_data_source
    from disagg.runtime.plan import families_for

    cfg = _config(tiny, tmp_path / "x", DDP, DDP)
    source = build_data_source(cfg, families_for(cfg, get_registry()))
    model = LlavaForConditionalGeneration.from_pretrained(tiny["models"]["llava"], dtype=torch.float32)
    total, count = 0.0, 0
    for s in next(source.batches(0)):
        llm = ray.get(s.inputs["llm"])
        kw = {"pixel_values": ray.get(s.inputs["vision"])["pixel_values"]} if "vision" in s.inputs else {}
        out = model(input_ids=llm["input_ids"][None], labels=llm["labels"][None], **kw)
        n = int((llm["labels"][1:] != -100).sum())
        total += float(out.loss.detach()) * n
        count += n
    assert all_ddp[0][0] == pytest.approx(total / count, rel=1e-5)
