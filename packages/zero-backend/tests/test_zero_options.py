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
    )
    assert cfg["gradient_clipping"] == 0.0 and cfg["gradient_allreduce_op"] == "sum"
    # train.precision: fp32 (the default) never turns DeepSpeed's bf16 mode on
    assert cfg["bf16"] == {"enabled": False} and "communication_data_type" not in cfg
    z = cfg["zero_optimization"]
    assert z == {
        "stage": 2,
        "reduce_bucket_size": 1000,
        "overlap_comm": False,
        "offload_optimizer": {"device": "cpu"},
        "contiguous_gradients": False,
    }
    # stage 3 can only average: the backward seed carries the world size instead
    assert build_ds_config(ZeroOptions(stage=3))["gradient_allreduce_op"] == "mean"
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
    """Each ``train.precision`` recipe's DeepSpeed mode, as DeepSpeed's own config parser reads
    it: bf16 weights, master/state dtypes, and the dtypes gradients are accumulated and
    reduced in (``bf16``: fp32, not DeepSpeed's bf16 default)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    parsed = DeepSpeedConfig(build_ds_config(ZeroOptions(stage=3), precision))
    bf16 = parsed.bfloat16_config
    assert bf16.enabled == (precision != "fp32")
    assert bf16.bf16_master_weights_and_grads == bf16.bf16_optimizer_states == (precision == "bf16-pure")
    assert not bf16.check_grad_overflow or precision == "fp32"
    want = {"fp32": None, "bf16": torch.float32, "bf16-pure": torch.bfloat16}[precision]
    assert parsed.communication_data_type == want
    assert parsed.grad_accum_dtype == {"fp32": None, "bf16": "fp32", "bf16-pure": "bf16"}[precision]


def test_unknown_precision_lists_allowed() -> None:
    with pytest.raises(ValueError, match="unknown precision 'fp16'; allowed: fp32, bf16, bf16-pure"):
        build_ds_config(ZeroOptions(), "fp16")


def test_every_recipe_is_honoured_but_not_with_an_offloaded_optimizer() -> None:
    """``zero`` honours the three recipes in DeepSpeed's own mode; an offloaded optimizer under
    ``bf16`` at stage 2 (not verified against the run without it) or ``bf16-pure`` (DeepSpeed
    offloads bf16 masters only with its own CPU Adam) is refused at validation, naming
    ``train.precision`` and the module's keys, through core's ``train.precision`` check (before
    any actor starts)."""
    from types import SimpleNamespace

    from disagg.config.train_checks import precision_problems

    assert ZeroStrategy.precisions == ("fp32", "bf16", "bf16-pure")
    for stage in (1, 2, 3):
        assert ZeroStrategy.precision_problems("bf16", ZeroOptions(stage=stage), "parallel.llm") == []
        assert (
            ZeroStrategy.precision_problems("fp32", ZeroOptions(stage=stage, offload_optimizer=True), "x")
            == []
        )

    def resolved(precision: str, **options: object) -> SimpleNamespace:
        module = SimpleNamespace(strategy=ZeroStrategy, options=ZeroOptions(**options))
        return SimpleNamespace(
            config=SimpleNamespace(train=SimpleNamespace(precision=precision)), modules={"llm": module}
        )

    for precision in ("bf16", "bf16-pure"):
        got = precision_problems(resolved(precision, stage=2, offload_optimizer=True), "cuda")
        assert [key for key, _ in got] == [("train", "precision")]
        msg = got[0][1]
        assert f"train.precision: {precision!r} cannot be combined with parallel.llm.offload_optimizer" in msg
        assert (
            "parallel.llm.stage: 2" in msg and "set offload_optimizer: false or train.precision: fp32" in msg
        )
        assert precision_problems(resolved(precision, stage=3), "cuda") == []


def test_bf16_with_an_offloaded_optimizer_is_allowed_where_verified() -> None:
    """``bf16`` + ``offload_optimizer`` at stages 1 and 3 equals the run without offload
    (``tests/test_offload.py``), so validation lets it through; ``bf16-pure`` stays refused at
    every stage with DeepSpeed's reason, and ``bf16`` at stage 2 with the stages to use."""
    from types import SimpleNamespace

    from disagg.config.train_checks import precision_problems

    for stage in (1, 3):
        options = ZeroOptions(stage=stage, offload="optimizer")
        assert ZeroStrategy.precision_problems("bf16", options, "parallel.llm") == []
        module = SimpleNamespace(strategy=ZeroStrategy, options=options)
        train = SimpleNamespace(train=SimpleNamespace(precision="bf16"))
        assert precision_problems(SimpleNamespace(config=train, modules={"llm": module}), "cuda") == []
    (stage2,) = ZeroStrategy.precision_problems("bf16", ZeroOptions(stage=2, offload_optimizer=True), "p")
    assert "verified against the run without it at stages 1 and 3 only" in stage2
    assert "(or stage: 1 or 3)" in stage2
    for stage in (1, 2, 3):
        (pure,) = ZeroStrategy.precision_problems(
            "bf16-pure", ZeroOptions(stage=stage, offload_optimizer=True), "parallel.vision"
        )
        assert "only with its own DeepSpeedCPUAdam" in pure and "parallel.vision.stage" in pure
