"""Config-time behaviour of ``zero``: options, errors, the DeepSpeed config it builds, registration."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from disagg import plugins
from disagg.testing.toy import ToyLMFamily, make_toy_dirs
from disagg_zero import ZeroOptions, ZeroStrategy
from disagg_zero.dsconfig import backward_scale, build_ds_config


@pytest.mark.parametrize("bad", [0, 4, "two", True])
def test_unknown_stage_lists_allowed(bad: object) -> None:
    with pytest.raises(ValidationError) as exc:
        ZeroOptions(stage=bad)
    msg = str(exc.value)
    assert "stage" in msg and repr(bad) in msg and "allowed: 1, 2, 3" in msg


def test_unknown_option_rejected() -> None:
    with pytest.raises(ValidationError, match="offload_optimiser"):
        ZeroOptions(offload_optimiser=True)


@pytest.mark.parametrize("key", ["gradient_clipping", "optimizer", "gradient_accumulation_steps", "fp16"])
def test_ds_config_keys_the_strategy_owns_are_rejected(key: str) -> None:
    with pytest.raises(ValidationError, match=f"ds_config.{key} cannot be set"):
        ZeroOptions(ds_config={key: 1})


def test_ds_config_stage_points_to_the_option() -> None:
    with pytest.raises(ValidationError, match="use the `stage` option"):
        ZeroOptions(ds_config={"zero_optimization": {"stage": 3}})


@pytest.fixture(scope="module")
def lm_family(tmp_path_factory: pytest.TempPathFactory) -> ToyLMFamily:
    _, lm = make_toy_dirs(tmp_path_factory.mktemp("toy"))
    return ToyLMFamily(lm)


def test_check_rejects_degree(lm_family: ToyLMFamily) -> None:
    problems = ZeroStrategy.check(lm_family, 2, 2, ZeroOptions())
    assert len(problems) == 1 and "degree must be 1, got 2" in problems[0] and "replicas=4" in problems[0]
    assert ZeroStrategy.check(lm_family, 1, 4, ZeroOptions(stage=3)) == []


def test_check_surfaces_deepspeed_schema_errors_with_key(lm_family: ToyLMFamily) -> None:
    opts = ZeroOptions(
        ds_config={"zero_optimization": {"stage3_prefetch_bucket_sise": 5, "overlap_comm": "maybe"}}
    )
    problems = ZeroStrategy.check(lm_family, 1, 2, opts)
    joined = "\n".join(problems)
    assert "ds_config.zero_optimization.stage3_prefetch_bucket_sise" in joined
    assert "ds_config.zero_optimization.overlap_comm" in joined and "'maybe'" in joined


def test_ds_config_sums_and_never_clips() -> None:
    cfg = build_ds_config(
        ZeroOptions(
            stage=2,
            reduce_bucket_size=1000,
            overlap_comm=False,
            offload_optimizer=True,
            ds_config={"zero_optimization": {"contiguous_gradients": False}},
        ),
        torch.bfloat16,
    )
    assert cfg["gradient_clipping"] == 0.0 and cfg["gradient_allreduce_op"] == "sum"
    # core's dtype rule: fp32 master weights under autocast, never DeepSpeed's bf16 mode
    assert cfg["bf16"] == {"enabled": False}
    z = cfg["zero_optimization"]
    assert z == {
        "stage": 2,
        "reduce_bucket_size": 1000,
        "overlap_comm": False,
        "offload_optimizer": {"device": "cpu"},
        "contiguous_gradients": False,
    }
    # stage 3 can only average: the backward seed carries the world size instead
    assert build_ds_config(ZeroOptions(stage=3), torch.float32)["gradient_allreduce_op"] == "mean"
    assert backward_scale(ZeroOptions(stage=3), 3) == 3.0 and backward_scale(ZeroOptions(stage=1), 3) == 1.0


def test_registered_through_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISAGG_PLUGINS", "zero")  # only this plugin's entry point
    pm, failures = plugins.make_plugin_manager()
    reg = plugins.build_registry(pm, failures)
    assert reg.strategies["zero"] is ZeroStrategy
    assert "zero" in reg.plugins and reg.plugins["zero"].registered["strategies"] == ["zero"]
    assert (
        ZeroStrategy.distribution == "disagg-zero"
        and plugins.KNOWN_PROVIDERS["strategy:zero"] == "disagg-zero"
    )


def test_plugin_module_registers_on_a_fresh_manager(disagg_registry: plugins.Registry) -> None:
    import disagg_zero.plugin

    reg = plugins.register_plugin(disagg_zero.plugin, name="zero-test")
    assert reg.strategies["zero"] is ZeroStrategy


def test_package_has_no_torch_pin() -> None:
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert "torch" not in text.split("dependencies")[1].split("]")[0]


def test_activation_checkpointing_is_a_deprecated_spelling_of_recompute_full() -> None:
    with pytest.warns(FutureWarning, match=r"activation_checkpointing is deprecated.*recompute: full"):
        opts = ZeroOptions(activation_checkpointing=True)
    assert opts.recompute == "full"
    with pytest.warns(FutureWarning):  # the new key wins where both are given
        assert ZeroOptions(activation_checkpointing=True, recompute="full").recompute == "full"
    assert ZeroOptions(recompute="full").recompute == "full"
    assert ZeroOptions().recompute == "none"
    assert ZeroStrategy.recompute_modes == ("none", "full")


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-pure"])
def test_precision_recipes_give_bf16_sections_deepspeed_accepts(precision: str) -> None:
    """Ready for ``train.precision`` (not a core key yet): each recipe's ``bf16`` section
    is what DeepSpeed's own schema accepts, with the recipe's master/state dtypes."""
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config

    section = build_ds_config(ZeroOptions(stage=3), torch.float32, precision)["bf16"]
    parsed = DeepSpeedBF16Config(**section)
    assert parsed.enabled == (precision != "fp32")
    assert parsed.bf16_master_weights_and_grads == parsed.bf16_optimizer_states == (precision == "bf16-pure")
    assert not parsed.check_grad_overflow or precision == "fp32"


def test_unknown_precision_lists_allowed() -> None:
    with pytest.raises(ValueError, match="unknown precision 'fp16'; allowed: fp32, bf16, bf16-pure"):
        build_ds_config(ZeroOptions(), torch.float32, "fp16")
