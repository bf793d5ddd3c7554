"""``run_training``, ``make_plan`` and bench take the config validation returned and
nothing else: only ``validate`` makes a :class:`ResolvedConfig`, so none of them
validates again, and a plain :class:`Config` is refused before anything starts."""

from __future__ import annotations

import pytest

from disagg.config.resolved import ResolvedConfig
from disagg.config.schema import Config
from disagg.runtime.plan import make_plan
from disagg.runtime.run import run_training

_RAW = {"model": {"llm": {"family": "toy", "path": "/nowhere"}}, "output_dir": "/nowhere/run"}


def test_a_plain_config_is_refused_naming_validate(tmp_path):
    cfg = Config.model_validate({**_RAW, "output_dir": str(tmp_path / "run")})
    with pytest.raises(
        TypeError, match=r"run_training takes the validated config.*validate\(cfg, registry\)"
    ):
        run_training(cfg, registry=object())  # type: ignore[arg-type]
    assert not (tmp_path / "run").exists()  # refused before the run dir is made
    with pytest.raises(TypeError, match=r"make_plan takes the validated config"):
        make_plan(cfg, None, 0)  # type: ignore[arg-type]


def test_only_validation_makes_a_resolved_config():
    with pytest.raises(TypeError, match=r"comes only from disagg.config.validate.validate"):
        ResolvedConfig(config=Config.model_validate(_RAW))
