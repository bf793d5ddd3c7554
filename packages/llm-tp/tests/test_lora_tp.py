"""LoRA under megatron_tp (column-parallel adapters: A replicated, B split; row-parallel: A split,
B replicated; ``disagg_llm_tp.lora``) equals the single-process PEFT model at TP 2, with and
without sequence parallelism and with it under ``recompute: full`` (every decoder layer, its
adapters in it, replayed in backward), in one spawn of two gloo ranks: loss, every adapter gradient
(merged from the ranks) and grad norm at each of 3 clipped AdamW steps within 1e-6 relative,
adapters after the steps in lr units (the tolerance policy), base weights bit-identical."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from lora_cases import SPEC, STEPS, reference, tp_lora_all  # noqa: E402
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
#: strategy options per case; megatron_tp recomputes ``none`` or ``full`` (selective is refused at
#: validation): sequence parallelism with every block replayed, the adapters in it
CASES = {
    "tp2": {},
    "tp2-sp": {"sequence_parallel": True},
    "tp2-sp-recompute-full": {"sequence_parallel": True, "recompute": "full"},
}


def _text(path: str, n: int) -> list[dict]:
    # the placeholder ids are ordinary tokens to a text-only model
    samples, _ = make_batch(family_cls("qwen2")(path), n_samples=n)
    return [{k: v for k, v in s.items() if k in ("input_ids", "labels")} for s in samples]


@pytest.fixture(scope="module")
def spawned(tiny_dirs):
    """One spawn of two ranks for both tests: per rank (equivalence cases, dropout modes)."""
    path = tiny_dirs["qwen2_untied"]
    payload = (dumps((path, _text(path, 3), list(CASES.values()))), dumps((path, _text(path, 2))))
    return path, [loads(r) for r in run_ranks(tp_lora_all, 2, dumps(payload))]


def test_lora_under_tensor_parallelism_equals_peft_model(spawned):
    path, outs = spawned
    ref = reference(path, _text(path, 3))
    per_rank = [o[0] for o in outs]
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
        if CASES[name].get("sequence_parallel"):  # the row adapters' A reduce-scattered with the base rows
            assert got["collectives"].get("reduce_scatter", 0) > 0
        # under full every adapter call of the forward ran again in backward; else none did
        forward, replayed = got["adapter_calls"]
        assert forward > 0 and replayed == (forward if CASES[name].get("recompute") == "full" else 0), (
            name,
            forward,
            replayed,
        )
    # B starts at zero (PEFT's init): after the steps every B has moved off it
    assert all(bool(ref["params"][k].abs().sum() > 0) for k in adapters if ".lora_B." in k)


def test_adapter_dropout_draws_as_the_rest_of_the_module(spawned):
    """A column adapter's input is the same on both TP ranks: both draw the same mask (the
    replica's adapter stream); a row adapter's input is each rank's feature shard: each draws
    its own (the TP rank's stream), so feature j and j + in/2 are not dropped together. A
    recomputed block replays the forward's masks: gradients under ``full`` equal ``none``'s
    bit for bit."""
    path, outs = spawned
    fam = family_cls("qwen2")(path)
    r0, r1 = (o[1] for o in outs)
    layers = fam.text_config.num_hidden_layers
    per_layer = len(SPEC.targets)  # q, k, v (column), o, down (row), in call order
    for mode in ("none",):  # under full the spy also records the replays in backward
        a, b = r0[mode]["masks"], r1[mode]["masks"]
        assert len(a) == len(b) == layers * per_layer, (len(a), layers)
        for i, (ma, mb) in enumerate(zip(a, b)):
            kind = SPEC.targets[i % per_layer]
            if kind in ("o_proj", "down_proj"):
                agree = float((ma == mb).float().mean())
                assert agree < 0.9, f"{mode}: row adapter {kind} of layer {i // per_layer}: agreement {agree}"
            else:
                assert torch.equal(ma, mb), f"{mode}: column adapter {kind} of layer {i // per_layer}"
    # the forward's masks come first under full too (its replays' follow, in backward)
    assert all(torch.equal(x, y) for x, y in zip(r0["none"]["masks"], r0["full"]["masks"]))
    assert_exact(r0["full"]["grads"], r0["none"]["grads"], "recompute full vs none ")
