"""Context parallelism (``parallel.llm.context_parallel``) on text-only Qwen2, one step against
the single-process Hugging Face model (loss, every weight gradient, the gradient norm), in one
spawn of 4 gloo ranks: ``ddp`` at CP 4, ``ddp`` at CP 2 x 2 uneven replicas, and
``megatron_tp`` at TP 2 x CP 2; ragged samples, one of them shorter than the CP degree.

The same step's measured K/V traffic per rank (bytes and calls of the all-gathers, and of the
reduce-scatters of their gradients) equals the strategy-level estimate
(:func:`disagg.kit.context_parallel.cost.kv_exchange`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from cp_cases import cp_rank, text_batch
from tp_cases import family_cls

from disagg.testing.dist import run_ranks
from disagg.testing.ranks import dumps, loads
from disagg.testing.tolerance import assert_scalar_close, assert_tensors_close

CASES = [("ddp", 1, 4, 1), ("ddp", 1, 2, 2), ("megatron_tp", 2, 2, 1)]
LENGTHS = (13, 3, 22)  # the 3-token sample is shorter than CP 4; 3 samples over 2 replicas


@pytest.fixture(scope="module")
def results(tiny_dirs):
    path = tiny_dirs["qwen2"]
    samples = text_batch(family_cls("qwen2")(path).text_config.vocab_size, LENGTHS)
    out = [loads(b) for b in run_ranks(cp_rank, 4, dumps((path, samples, CASES, "bf16")))]
    return out, out[0][-1]


def test_bf16_context_parallel_equals_one_rank(results):
    """``train.precision: bf16`` (fp32 masters), 5 steps: ddp CP 4 equals ddp on one rank under
    the same recipe (``disagg.testing.recipes``' bounds)."""
    from dropout_cases import BF16_OPTIM

    from disagg.testing.recipes import assert_same_recipe

    per_rank, _ = results
    want = per_rank[0][len(CASES) + 1]
    for r in per_rank:
        assert_same_recipe(
            r[len(CASES)],
            want,
            "bf16",
            lr=BF16_OPTIM.lr,
            betas=BF16_OPTIM.betas,
            eps=BF16_OPTIM.eps,
            what="ddp cp4 ",
        )


@pytest.mark.parametrize("case", range(len(CASES)))
def test_context_parallel_step_equals_hf_model(results, case):
    per_rank, ref = results
    rows = [r[case] for r in per_rank]
    name = "{} tp{} cp{} x{} replicas".format(*CASES[case])
    assert all(r["active"] for r in rows), f"{name}: context parallelism was not installed"
    # each replica's loss is summed over its CP ranks; the driver adds one rank per replica
    by_replica = {r["replica"]: r["loss"] for r in rows}
    assert_scalar_close(sum(by_replica.values()), ref["loss"], f"{name} loss")
    want_norm = float(sum((g.double() ** 2).sum() for g in ref["grads"].values()))
    for r in rows:
        assert set(r["grads"]) == set(ref["grads"]), name
        assert_tensors_close(r["grads"], ref["grads"], f"{name} rank {r['rank']} gradient of ")
        assert_scalar_close(r["norm_sq"], want_norm, f"{name} rank {r['rank']} grad norm^2")


@pytest.mark.parametrize("case", range(len(CASES)))
def test_measured_kv_traffic_equals_estimate(results, case):
    per_rank, _ = results
    for r in (p[case] for p in per_rank):
        est = r["estimate"]
        assert est.forward_calls > 0
        assert r["calls"].get("cp_all_gather") == est.forward_calls, r["calls"]
        assert r["bytes"].get("cp_all_gather") == est.forward_bytes, r["bytes"]
        assert r["calls"].get("cp_reduce_scatter") == est.forward_calls, r["calls"]
        assert r["bytes"].get("cp_reduce_scatter") == est.forward_bytes, r["bytes"]


def test_split_is_load_balanced_and_covering():
    from disagg.kit.context_parallel import gathered_order, local_positions, padded_length

    assert padded_length(3, 4) == 8 and padded_length(9, 2) == 12 and padded_length(8, 2) == 8
    n, length = 4, 16
    parts = [local_positions(length, n, r) for r in range(n)]
    assert parts[0].tolist() == [0, 1, 14, 15] and parts[3].tolist() == [6, 7, 8, 9]
    assert sorted(torch.cat(parts).tolist()) == list(range(length))
    # causal work (keys each query sees) is the same on every rank
    assert len({int((p + 1).sum()) for p in parts}) == 1
    held = torch.cat(parts)
    assert held[gathered_order(length, n)].tolist() == list(range(length))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_strategy_estimate_states_the_measured_kv_traffic(results, tiny_dirs, case):
    """Each strategy's own ``estimate`` at ``context_parallel`` N carries the K/V all-gather and
    reduce-scatter bytes and calls a rank of the busiest replica measured, and 1/N of the
    whole-sample rank's FLOPs."""
    from disagg.builtin.ddp import DDPStrategy
    from disagg.interfaces import CostQuery
    from disagg_llm_tp.strategy import MegatronTPStrategy

    per_rank, _ = results
    strategy, degree, cp, replicas = CASES[case]
    cls = MegatronTPStrategy if strategy == "megatron_tp" else DDPStrategy
    fam = family_cls("qwen2")(tiny_dirs["qwen2"])
    shape = fam.planning_shape(fam.text_config.to_dict())
    options = cls.options_model(loss_chunk_tokens=None)
    query = CostQuery(shape, degree, replicas, max(LENGTHS), precision="fp32", samples=len(LENGTHS))
    cost = cls.estimate(dataclasses.replace(query, context_parallel=cp), options)
    whole = cls.estimate(query, options)
    assert cost is not None and whole is not None
    busiest = [p[case] for p in per_rank if p[case]["replica"] == 0]
    for r in busiest:
        for kind in ("cp_all_gather", "cp_reduce_scatter"):
            assert cost.comm_bytes_by_kind[kind] == r["bytes"][kind], (kind, r["bytes"])
            assert cost.comm_calls_by_kind[kind] == r["calls"][kind], (kind, r["calls"])
    assert cost.flops == pytest.approx(whole.flops / cp)
