"""A megatron_tp-trained LLM exported to an HF dir loads with from_pretrained
and reproduces the trained model's loss."""

from __future__ import annotations

import torch
from tp_cases import Case, _hf_logits, family_cls, make_batch, run_tp

from disagg.kit.hf import checkpoint_keys
from disagg.testing.tolerance import assert_scalar_close
from disagg_llm_tp.families.base import write_hf_dir


def test_export_roundtrip(tiny_dirs, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    src = tiny_dirs["qwen2"]
    fam = family_cls("qwen2")(src)
    samples, embeds = make_batch(fam, n_samples=2, seed=3)
    case = Case("qwen2", src, degree=2, replicas=1, steps=2, samples=samples, embeds=embeds)
    outs = run_tp(case)
    state = fam.export_state(outs[0]["params"])
    assert "lm_head.weight" not in state  # tied: saved once, as HF does
    out = write_hf_dir(fam.path, tmp_path / "exported", state)
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        assert set(fh.keys()) == set(checkpoint_keys(fam.path))

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        loss = 0.0
        for s, e in zip(samples, embeds):
            logits = _hf_logits(case, fam, model, s, e)[0]
            loss += float(
                torch.nn.functional.cross_entropy(
                    logits[:-1], s["labels"][1:], ignore_index=-100, reduction="sum"
                )
            )
    assert_scalar_close(outs[0]["final_loss"], loss, "exported model's loss")
    # The export is the trained model, not the initial one.
    orig = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    assert not torch.equal(orig.model.norm.weight, model.model.norm.weight)


def test_qwen2_5_vl_export_keys_match_dir(tiny_dirs):
    """The LLM half of a whole Qwen2.5-VL dir maps back to the dir's own key names."""
    fam = family_cls("qwen2_5_vl")(tiny_dirs["qwen2_5_vl"])
    module = fam.build()
    exported = fam.export_state(module.state_dict())
    keys = set(checkpoint_keys(fam.path))
    assert set(exported) <= keys
    assert {k for k in keys if "visual" not in k} == set(exported)
