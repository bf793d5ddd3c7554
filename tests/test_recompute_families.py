"""``recompute: full`` in every first-party family, one process (``ddp`` on one rank).

Each family's module is built from its tiny dir with dropout > 0 wherever it has
dropout; a forward + backward with ``full`` must give bit-for-bit the outputs
and gradients of ``none`` (same process, same kernels: the policy's exact
check), and recompute every one of the family's transformer blocks (the HF
gradient-checkpointing layers the strategy wires). The strategies' own replays
(ulysses, megatron_tp, zero, several ranks) are in ``test_recompute.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from recompute_cases import set_dropout

from disagg.testing import ranks
from disagg.testing.tolerance import assert_exact

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")
pytest.importorskip("disagg_audio")


def _families(root):  # noqa: ANN001, ANN202
    from disagg_audio.families.qwen2_audio import Qwen2AudioFamily
    from disagg_audio.families.whisper import WhisperAudioFamily
    from disagg_llm_tp.families.llama import LlamaFamily
    from disagg_llm_tp.families.qwen2 import Qwen2Family
    from disagg_llm_tp.families.qwen2_5_vl import Qwen25VLLanguageFamily
    from disagg_vision_sp.families.llava import LlavaVision
    from disagg_vision_sp.families.qwen2_5_vl import Qwen2_5_VLVision

    out = {}
    for cls in (
        Qwen2_5_VLVision,
        LlavaVision,
        WhisperAudioFamily,
        Qwen2AudioFamily,
        Qwen2Family,
        LlamaFamily,
        Qwen25VLLanguageFamily,
    ):
        path = cls.make_tiny(root / cls.name / cls.role)
        options = {"attn_implementation": "eager"} if cls is not Qwen2_5_VLVision else {}
        if cls is WhisperAudioFamily:
            options["hidden_size"] = 48  # the LLM width its projector maps to
        out[f"{cls.role}:{cls.name}"] = cls(path, options)
    return out


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    return _families(tmp_path_factory.mktemp("fam"))


def _inputs(family):  # noqa: ANN001, ANN202
    if family.role == "llm":
        from recompute_cases import llm_steps

        return llm_steps(family)[0]
    if getattr(family, "modality", "image") == "audio":
        rng = np.random.default_rng(0)
        clips = [
            [{"array": rng.standard_normal(16000 * s).astype(np.float32) * 0.1, "sampling_rate": 16000}]
            for s in (1, 2)
        ]
        xs = [family.preprocess(c) for c in clips]
    else:
        from disagg_vision_sp.testing import random_images

        xs = [
            family.preprocess(random_images(s, seed=i))
            for i, s in enumerate([[(56, 56)], [(28, 28), (56, 28)]])
        ]
    g = torch.Generator().manual_seed(0)
    return [(x, torch.randn(sum(family.num_tokens(x)), family.hidden_size(), generator=g)) for x in xs]


def _run(family, mode: str, batch):  # noqa: ANN001, ANN202
    from transformers.modeling_layers import GradientCheckpointingLayer

    from disagg.builtin.ddp import DDPStrategy

    ctx = ranks.rank_context(family.role, 0, 1, 1, seed=1)
    torch.manual_seed(0)
    module = family.build(torch.float32)
    assert set_dropout(module, 0.2)
    strat = ranks.strategy_rank(
        DDPStrategy, family, ctx, options={"recompute": mode}, train=True, module=module
    )
    blocks = [m for m in strat.module.modules() if isinstance(m, GradientCheckpointingLayer)]
    torch.manual_seed(7)
    if family.role == "llm":
        leaves = ranks.leaves([e for _, e in batch])
        total = sum(int((s["labels"][1:] != -100).sum()) for s, _ in batch)
        loss = ranks.loss_and_backward(strat, 0, [s for s, _ in batch], leaves, 1.0 / total)
        outs = [torch.tensor(loss)] + [v.grad for e in leaves for v in e.values()]
    else:
        shards = ranks.encode_and_backward(strat, 0, [x for x, _ in batch], [g for _, g in batch])
        outs = [s.value.detach() for s in shards]
    grads = {n: p.grad for n, p in strat.module.named_parameters() if p.grad is not None}
    return outs, grads, blocks


@pytest.mark.parametrize(
    "name",
    [
        "encoder:qwen2_5_vl",
        "encoder:llava",
        "encoder:whisper",
        "encoder:qwen2_audio",
        "llm:qwen2",
        "llm:llama",
        "llm:qwen2_5_vl",
    ],
)
def test_full_recompute_is_exact_in_every_family(families, name):
    family = families[name]
    batch = _inputs(family)
    outs, grads, _ = _run(family, "none", batch)
    outs_rc, grads_rc, blocks = _run(family, "full", batch)
    assert blocks and all(b.gradient_checkpointing for b in blocks), "every block recomputes"
    assert grads, "gradients must flow"
    for k, (a, b) in enumerate(zip(outs_rc, outs)):
        assert_exact(a, b, f"{name} output {k}")
    assert_exact(grads_rc, grads, f"{name} grad ")
