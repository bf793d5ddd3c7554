"""What LoRA saves, measured on the tiny Qwen2.5-VL under ``ddp`` (2 replicas), one step of
each module trained in full and with LoRA (``examples/bench/lora_bytes.py``), and (in the same
spawn) each recipe's saved activations (``examples/bench/recipe_activations.py``): every rank's
state bytes (parameters + gradients + AdamW state) and the gradient bytes its collectives sent
equal the cost model's figures exactly: ``ddp``'s ``Strategy.estimate`` for the same layout with
``CostQuery.lora`` (the planning shape from ``config.json``, the targeted linears frozen with a
lora_A/lora_B pair each, :mod:`disagg.kit.cost.training`): a frozen base weight holds its
4 bytes, no gradient and no optimizer state, and is never all-reduced. So LoRA / full, measured,
equals LoRA / full, analytic."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "bench"))


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One spawn of two ranks for both measurements: LoRA / full bytes and the recipes'
    saved activations (``examples/bench/recipe_activations.py``, ``test_recipe_activations``)."""
    from lora_bytes import analytic
    from recipe_activations import rows, with_lora_bytes

    from disagg.cli.make_tiny import make_tiny
    from disagg.testing.dist import run_ranks
    from disagg.testing.ranks import loads

    path = make_tiny(tmp_path_factory.mktemp("tiny"), ["qwen2_5_vl"], data=False)["models"]["qwen2_5_vl"]
    per_rank = [loads(r) for r in run_ranks(with_lora_bytes, 2, path)]
    lora = per_rank[0]["lora"]
    for key, figures in analytic(path).items():
        lora[key].update(figures)
    return {"lora": lora, "recipes": rows(path, [r["recipes"] for r in per_rank])}


def test_lora_state_and_gradient_bytes_equal_the_analytic_ones(measured):
    rows = measured["lora"]
    for key, r in rows.items():
        assert r["state_bytes"] == r["state_bytes_analytic"], (key, r)
        assert r["grad_bytes_sent"] == r["grad_bytes_analytic"], (key, r)
    for m in ("vision", "llm"):
        full, lora = rows[f"{m}/full"], rows[f"{m}/lora"]
        assert lora["frozen"] > 0 and full["frozen"] == 0, (m, full, lora)
        assert lora["state_bytes"] < full["state_bytes"] and lora["grad_bytes_sent"] < full["grad_bytes_sent"]
        for measured, analytic in (
            ("state_bytes", "state_bytes_analytic"),
            ("grad_bytes_sent", "grad_bytes_analytic"),
        ):
            assert lora[measured] / full[measured] == lora[analytic] / full[analytic], (m, measured)


def test_saved_activations_equal_the_model_within_10_percent_per_recipe(measured):
    """Measured saved-activation bytes equal the cost model within 10% for each ``train.precision``
    recipe on the tiny Qwen2.5-VL (one microbatch per module and recipe on the same two ranks, the
    tower under ``ulysses`` 2, the LLM under ``megatron_tp`` 2 with sequence parallelism): exact in
    ``fp32``; under ``bf16`` and ``bf16-pure`` activations are bf16 but for what HF's code keeps in
    fp32 (RMSNorm's input and rsqrt, the vision rotary's cos/sin, the loss's logits), which the model
    counts (``cost_rules.fp32_internal_bytes``)."""
    from recipe_activations import RECIPES

    rows = measured["recipes"]
    assert set(rows) == {f"{m}/{p}" for m in ("vision", "llm") for p in RECIPES}
    for key, r in rows.items():
        assert abs(r["analytic"] - r["measured"]) <= 0.10 * r["measured"], (key, r)
        if key.endswith("/fp32"):
            assert r["analytic"] == r["measured"], (key, r)
    for m in ("vision", "llm"):  # the compute dtype halves what is not kept in fp32
        assert rows[f"{m}/bf16"]["measured"] < 0.7 * rows[f"{m}/fp32"]["measured"]
