"""What LoRA saves, measured on the tiny Qwen2.5-VL under ``ddp`` (2 replicas), one step of
each module trained in full and with LoRA (``examples/bench/lora_bytes.py``): every rank's
state bytes (parameters + gradients + AdamW state) and the gradient bytes its collectives sent
equal the cost model's figures exactly: ``ddp``'s ``Strategy.estimate`` for the same layout with
``CostQuery.lora`` (the planning shape from ``config.json``, the targeted linears frozen with a
lora_A/lora_B pair each, :mod:`disagg.interfaces.cost_training`): a frozen base weight holds its
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


def test_lora_state_and_gradient_bytes_equal_the_analytic_ones(tmp_path):
    from lora_bytes import measure

    from disagg.cli.make_tiny import make_tiny

    rows = measure(make_tiny(tmp_path, ["qwen2_5_vl"], data=False)["models"]["qwen2_5_vl"])
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
