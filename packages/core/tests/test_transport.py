"""Transport selection per device and placement, and refusals with the reason,
before any actor starts (``validate`` with the device known; the plan once
``auto`` is resolved)."""

from __future__ import annotations

import pytest

from disagg.config.errors import ConfigError
from disagg.config.schema import Config
from disagg.config.validate import validate
from disagg.plugins import register_plugin
from disagg.runtime.plan import make_plan
from disagg.testing import toy
from disagg.testing.toy import make_toy_dirs


def _cfg(tmp_path, transport="auto", placement="collocated", device="auto", vision=None, llm=None):
    enc, lm = make_toy_dirs(tmp_path)
    return Config.model_validate(
        {
            "model": {
                "vision": {"family": "toy", "path": str(enc)},
                "llm": {"family": "toy", "path": str(lm)},
            },
            "parallel": {
                "transport": transport,
                "placement": placement,
                "vision": vision or {},
                "llm": llm or {},
            },
            "train": {"device": device},
            "output_dir": str(tmp_path / "run"),
        }
    )


@pytest.fixture
def reg(disagg_registry):
    return register_plugin(toy, name="disagg.testing.toy")


@pytest.fixture
def with_cupy(reg, monkeypatch):
    """As if cupy were installed (it is not on CPU machines): NCCL becomes usable."""
    monkeypatch.setattr(reg.transports["nccl"], "unavailable_reason", None)
    return reg


def _auto(cfg, reg, gpus):
    plan = make_plan(validate(cfg, reg), reg, cluster_gpus=gpus)
    return plan.transport.name, plan.device, plan.precision


def test_auto_is_object_store_on_cpu_in_every_placement(with_cupy, tmp_path):
    for placement in ("collocated", "disaggregated"):
        assert _auto(_cfg(tmp_path, placement=placement), with_cupy, 0) == ("object_store", "cpu", "fp32")


def test_auto_on_cuda_is_cuda_ipc_when_every_group_shares_one_gpu(reg, tmp_path):
    assert _auto(_cfg(tmp_path), reg, 1) == ("cuda_ipc", "cuda", "bf16")


def test_auto_on_cuda_collocated_with_several_ranks_is_object_store(with_cupy, tmp_path):
    # an encoder rank also sends to LLM ranks on other GPUs: neither IPC nor NCCL (shared GPUs) fits
    cfg = _cfg(tmp_path, vision={"replicas": 2}, llm={"replicas": 2})
    assert _auto(cfg, with_cupy, 2)[0] == "object_store"


def test_auto_on_cuda_disaggregated_is_nccl_only_with_cupy(reg, tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, placement="disaggregated")
    assert reg.transports["nccl"].unavailable_reason and "cupy" in reg.transports["nccl"].unavailable_reason
    assert _auto(cfg, reg, 2)[0] == "object_store"
    monkeypatch.setattr(reg.transports["nccl"], "unavailable_reason", None)
    assert _auto(cfg, reg, 2)[0] == "nccl"


def _refused(fn, match):
    with pytest.raises(ConfigError, match=match) as err:
        fn()
    assert [p.key for p in err.value.problems] == ["parallel.transport"], err.value.problems
    return str(err.value)


def test_nccl_between_collocated_groups_is_refused_with_the_reason(with_cupy, tmp_path):
    match = r"parallel.transport.*'nccl' cannot work.*duplicate GPU.*object_store"
    cfg = _cfg(tmp_path, transport="nccl", device="cuda")
    _refused(lambda: validate(cfg, with_cupy), match)
    cfg = _cfg(tmp_path, transport="nccl")  # device auto: the same refusal (placement decides it)
    _refused(lambda: validate(cfg, with_cupy), match)
    _refused(lambda: make_plan(validate(cfg, with_cupy), with_cupy, cluster_gpus=1), match)


def test_nccl_without_cupy_is_refused_naming_the_extra(reg, tmp_path):
    cfg = _cfg(tmp_path, transport="nccl", placement="disaggregated")
    _refused(lambda: validate(cfg, reg), r"'nccl' cannot be used.*cupy.*disagg-core\[nccl\]")


def test_cuda_ipc_is_refused_where_producer_and_consumer_do_not_share_a_gpu(reg, tmp_path):
    cfg = _cfg(tmp_path, transport="cuda_ipc", placement="disaggregated", device="cuda")
    _refused(lambda: validate(cfg, reg), r"'cuda_ipc' cannot work.*GPUs of their own")
    cfg = _cfg(tmp_path, transport="cuda_ipc", llm={"degree": 1, "replicas": 2})
    _refused(
        lambda: make_plan(validate(cfg, reg), reg, cluster_gpus=2),
        r"'cuda_ipc' cannot work.*\(llm\).*other GPUs",
    )
    assert (
        make_plan(validate(_cfg(tmp_path, transport="cuda_ipc"), reg), reg, cluster_gpus=1).transport.name
        == "cuda_ipc"
    )


def test_cuda_transport_on_cpu_is_refused(reg, tmp_path):
    cfg = _cfg(tmp_path, transport="cuda_ipc", device="cpu")
    allowed = "allowed there: auto, object_store"
    _refused(lambda: validate(cfg, reg), rf"'cuda_ipc' does not work on cpu; {allowed}")
    _refused(
        lambda: make_plan(validate(_cfg(tmp_path, transport="cuda_ipc"), reg), reg, 0),
        r"does not work on cpu",
    )


def test_gloo_direct_transport_is_refused_with_reason(reg, tmp_path):
    with pytest.raises(
        ConfigError, match=r"parallel.transport.*default torch.distributed group.*object_store"
    ):
        validate(_cfg(tmp_path, "gloo"), reg)
