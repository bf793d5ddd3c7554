"""LoRA under megatron_tp (column-parallel adapters: A replicated, B split; row-parallel: A split,
B replicated; ``disagg_llm_tp.lora``) equals the single-process PEFT model at TP 2, with and
without sequence parallelism, in one spawn of two gloo ranks: loss, every adapter gradient
(merged from the ranks) and grad norm at each of 3 clipped AdamW steps within 1e-6 relative,
adapters after the steps in lr units (the tolerance policy), base weights bit-identical."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from lora_cases import STEPS, reference, tp_lora_rank  # noqa: E402
from tp_cases import LR, family_cls, make_batch  # noqa: E402

from disagg.testing.dist import run_ranks  # noqa: E402
from disagg.testing.ranks import dumps, loads  # noqa: E402
from disagg.testing.tolerance import (  # noqa: E402
    FP32,
    Precision,
    assert_exact,
    assert_params_close,
    assert_scalar_close,
    assert_tensors_close,
    first_grads,
)

TIGHT = Precision("fp32-1e-6", rtol=1e-6, param_unit=FP32.param_unit)
CASES = {"tp2": False, "tp2-sp": True}


def test_lora_under_tensor_parallelism_equals_peft_model(tiny_dirs):
    path = tiny_dirs["qwen2_untied"]
    fam = family_cls("qwen2")(path)
    samples, _ = make_batch(fam, n_samples=3)
    samples = [{k: v for k, v in s.items() if k in ("input_ids", "labels")} for s in samples]
    # the placeholder ids are ordinary tokens to a text-only model
    ref = reference(path, samples)
    raw = run_ranks(tp_lora_rank, 2, dumps((path, samples, list(CASES.values()))))
    per_rank = [loads(r) for r in raw]
    adapters = sorted(ref["grads"][0])
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters), adapters[:4]
    for i, name in enumerate(CASES):
        got = per_rank[0][i]
        assert got["trainable"] == adapters, name
        for step in range(STEPS):
            assert_scalar_close(got["loss"][step], ref["loss"][step], f"{name} step {step + 1} loss", TIGHT)
            assert_tensors_close(got["grads"][step], ref["grads"][step], f"{name} step {step + 1} ", TIGHT)
            want_sq = sum(float(g.double().pow(2).sum()) for g in ref["grads"][step].values())
            for r in per_rank:
                assert_scalar_close(r[i]["norm_sq"][step], want_sq, f"{name} step {step + 1} norm²", TIGHT)
        params = got["params"]
        assert set(params) == set(ref["params"]), sorted(set(params) ^ set(ref["params"]))[:6]
        assert_params_close(
            {k: params[k] for k in adapters},
            {k: ref["params"][k] for k in adapters},
            lr=LR,
            steps=STEPS,
            grads=first_grads(ref["grads"]),
            what=f"{name} after {STEPS} steps: ",
            precision=TIGHT,
            eps=1e-3,
        )
        base = {k: params[k] for k in params if k not in adapters}
        initial = {k.replace(".base_layer.", "."): k for k in base}
        assert_exact(base, {k: ref["initial"][short] for short, k in initial.items()}, f"{name} base ")
        if CASES[name]:  # the row adapters' A reduce-scattered with the base rows
            assert got["collectives"].get("reduce_scatter", 0) > 0
    # B starts at zero (PEFT's init): after the steps every B has moved off it
    assert all(bool(ref["params"][k].abs().sum() > 0) for k in adapters if ".lora_B." in k)
