"""Schedules through the orchestrator (toy model, ``ddp``): ``encoders_ahead``
equals the single-process reference, an encoder holds at most
``max_inflight`` microbatches of activations, and a frozen encoder holds none."""

from __future__ import annotations

import pytest
import torch

from disagg.builtin.ddp import DDPStrategy
from disagg.builtin.schedules import EncodersAhead, Sequential
from disagg.interfaces import OptimSpec, StrategyOptions
from disagg.runtime.groups import GroupSpec
from disagg.runtime.orchestrator import Orchestrator
from disagg.testing.reference import ReferenceModel
from disagg.testing.tolerance import BF16, assert_scalar_close
from disagg.testing.toy import ToyEncoderFamily, ToyLMFamily, make_toy_dirs, put_samples, toy_samples


@pytest.fixture(scope="module")
def toy_dirs(tmp_path_factory):
    return make_toy_dirs(tmp_path_factory.mktemp("toy"))


def _orch(toy_dirs, optims, schedule, microbatches=4, max_inflight=2, replicas=2):
    enc, lm = toy_dirs
    return Orchestrator(
        [
            GroupSpec(
                "vision", ToyEncoderFamily(enc), DDPStrategy, StrategyOptions(), 1, replicas, optims["vision"]
            ),
            GroupSpec("llm", ToyLMFamily(lm), DDPStrategy, StrategyOptions(), 1, 1, optims["llm"]),
        ],
        microbatches=microbatches,
        clip_grad_norm=0.5,
        schedule=schedule,
        max_inflight=max_inflight,
    )


def test_encoders_ahead_equals_single_process(ray_local, toy_dirs):
    optims = {"vision": OptimSpec(lr=1e-2, weight_decay=0.1, eps=1e-3), "llm": OptimSpec(lr=2e-2, eps=1e-3)}
    ref = ReferenceModel({"vision": ToyEncoderFamily(toy_dirs[0]), "llm": ToyLMFamily(toy_dirs[1])}, optims)
    orch = _orch(toy_dirs, optims, EncodersAhead(), microbatches=4, max_inflight=2)
    try:
        for s in range(3):
            samples = toy_samples(8, seed=20 + s, text_only_every=3)
            want = ref.step(samples, 0.5)
            got = orch.step(put_samples(samples, start=s * 8))
            assert_scalar_close(got.loss, want.loss, f"step {s} loss")
            assert_scalar_close(got.grad_norm, want.grad_norm, f"step {s} grad norm")
            for m in want.params:
                ref.assert_params_match(m, orch.full_state_dict(m), what=f"step {s} {m} ")
            assert set(got.groups["llm"]) >= {"wait_s", "busy_s", "collective_bytes_per_rank"}
            assert [r.rank for r in got.records["vision"]] == [0, 1]
    finally:
        orch.shutdown()


def _same_samples(n: int) -> list:
    one = toy_samples(1, seed=5)[0]
    return put_samples([one] * n)  # equal microbatches: each saves the same activation bytes


@pytest.mark.parametrize("max_inflight", [2, 3])
def test_live_activations_stay_within_max_inflight(ray_local, toy_dirs, max_inflight):
    optims = {"vision": OptimSpec(lr=1e-2), "llm": OptimSpec(lr=1e-2)}
    peaks = {}
    for name, schedule in (("sequential", Sequential()), ("ahead", EncodersAhead())):
        orch = _orch(toy_dirs, optims, schedule, microbatches=4, max_inflight=max_inflight, replicas=1)
        try:
            peaks[name] = orch.step(_same_samples(4)).groups["vision"]["activation_bytes_per_rank"]
        finally:
            orch.shutdown()
    one_microbatch = peaks["sequential"]
    assert one_microbatch > 0
    assert peaks["ahead"] == max_inflight * one_microbatch


def test_frozen_encoder_keeps_no_activations(ray_local, toy_dirs):
    optims = {"vision": None, "llm": OptimSpec(lr=1e-2)}
    orch = _orch(toy_dirs, optims, EncodersAhead(), microbatches=4, replicas=1)
    try:
        res = orch.step(_same_samples(4))
    finally:
        orch.shutdown()
    assert res.groups["vision"]["activation_bytes_per_rank"] == 0
    assert res.groups["llm"]["activation_bytes_per_rank"] > 0


def test_precision_recipes_through_the_orchestrator(ray_local, toy_dirs):
    """``train.precision`` through the orchestrator and the worker: under ``bf16`` the loss is
    close to float32's (not equal: the forward ran on bf16 weights) and the full form holds the
    float32 masters (``bf16-pure``'s bf16 state: the recipe tests and test_master_weights)."""
    optims = {"vision": OptimSpec(lr=1e-2), "llm": OptimSpec(lr=1e-2)}
    samples = toy_samples(4, seed=3)
    losses, dtypes = {}, {}
    for precision in ("fp32", "bf16"):
        enc, lm = toy_dirs
        orch = Orchestrator(
            [
                GroupSpec(
                    "vision", ToyEncoderFamily(enc), DDPStrategy, StrategyOptions(), 1, 1, optims["vision"]
                ),
                GroupSpec("llm", ToyLMFamily(lm), DDPStrategy, StrategyOptions(), 1, 2, optims["llm"]),
            ],
            precision=precision,
        )
        try:
            losses[precision] = orch.step(put_samples(samples)).loss
            dtypes[precision] = {v.dtype for v in orch.full_state_dict("llm").values()}
        finally:
            orch.shutdown()
    assert_scalar_close(losses["bf16"], losses["fp32"], "bf16 loss", BF16)
    assert losses["bf16"] != losses["fp32"]
    assert dtypes == {"fp32": {torch.float32}, "bf16": {torch.float32}}


def test_balanced_assignment_changes_where_samples_run_not_the_math(ray_local, toy_dirs):
    """Two encoder replicas and two LLM replicas, a batch mixing small and large
    images: the balanced split evens the replicas' tokens, and every step's
    loss, norm and parameters equal the contiguous split's."""
    from disagg.data.balance import balance
    from disagg.runtime.routing import contiguous

    optims = {"vision": OptimSpec(lr=1e-2, weight_decay=0.1, eps=1e-3), "llm": OptimSpec(lr=1e-2, eps=1e-3)}
    batches = [toy_samples(8, seed=40 + s, text_only_every=5) for s in range(2)]
    runs = {}
    for name, assign in (("contiguous", contiguous), ("balanced", balance)):
        enc, lm = toy_dirs
        orch = Orchestrator(
            [
                GroupSpec(
                    "vision", ToyEncoderFamily(enc), DDPStrategy, StrategyOptions(), 1, 2, optims["vision"]
                ),
                GroupSpec("llm", ToyLMFamily(lm), DDPStrategy, StrategyOptions(), 1, 2, optims["llm"]),
            ],
            clip_grad_norm=0.5,
            assign=assign,
        )
        try:
            refs = [put_samples(b, start=8 * s) for s, b in enumerate(batches)]
            for r in refs:  # toy samples carry no placeholder counts: give the router real costs
                for s in r:
                    if "vision" in s.inputs:
                        s.num_media_tokens["vision"] = int(
                            ray_local.get(s.inputs["llm"])["input_ids"].eq(3).sum()
                        )
            routes = [orch.route(r) for r in refs]
            results = [orch.step(r) for r in refs]
            runs[name] = (routes, results, orch.full_state_dict("vision"), orch.full_state_dict("llm"))
        finally:
            orch.shutdown()
    (r_c, res_c, v_c, l_c), (r_b, res_b, v_b, l_b) = runs["contiguous"], runs["balanced"]
    assert [t.samples for t in r_c[0].encodes] != [t.samples for t in r_b[0].encodes]
    # both splits against the single-process model (not only against each other)
    ref = ReferenceModel({"vision": ToyEncoderFamily(toy_dirs[0]), "llm": ToyLMFamily(toy_dirs[1])}, optims)
    for s, batch in enumerate(batches):
        want = ref.step(batch, 0.5)
        for name, res in (("contiguous", res_c), ("balanced", res_b)):
            assert_scalar_close(res[s].loss, want.loss, f"{name} step {s} loss")
            assert_scalar_close(res[s].grad_norm, want.grad_norm, f"{name} step {s} grad norm")
    for name, v, lm_state in (("contiguous", v_c, l_c), ("balanced", v_b, l_b)):
        ref.assert_params_match("vision", v, what=f"{name} vision ")
        ref.assert_params_match("llm", lm_state, what=f"{name} llm ")
