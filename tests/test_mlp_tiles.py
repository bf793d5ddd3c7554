"""``parallel.<module>.mlp_tiles``: each block's MLP over the sequence in checkpointed tiles
(:mod:`disagg.kit.recompute.tiled_mlp`) equals the same layout without tiles at every step, holds
what the cost model says, and sends what it says.

One spawn of 2 ranks (``tiles_cases.tiles_rank``): ``megatron_tp`` 2 with sequence parallelism
(``fp32`` and ``bf16``) and without it, ``ddp`` x 2, ``ulysses`` 2 and ``ulysses`` 2 with
``shard: parameters`` (FSDP2 around the tiled blocks), each under ``recompute: none`` and ``full``,
4 tiles against 1; the microbatches' rows are not multiples of 4 (uneven tiles). 3 clipped AdamW
steps of 2 microbatches, weight decay on.

Tolerance: the recipe's policy (:data:`disagg.testing.tolerance.RECIPE_PRECISION`), not bit for
bit: a weight's gradient is a sum over the tiles' products instead of one product over all rows
(another summation order), and a whole-rank matmul over fewer rows may pick another kernel
blocking (``ddp``'s and ``ulysses``' losses differ in the last bits; ``megatron_tp``'s measured
equal). The parameters after AdamW are held to the policy's lr-unit bound.

Saved bytes, per microbatch, as the worker counts them (``offload_cases._counted``: every saved
tensor, plus a replayed block's and a replayed tile's saves as peaks, a tile's on top of its
block's): without recompute the tiled run holds exactly what the cost model's count says less
(``megatron_tp``: :func:`disagg_llm_tp.cost.activation_bytes` with and without tiles, the same
difference byte for byte, ``fp32`` and ``bf16``, with and without sequence parallelism). Under
``full`` too: with sequence parallelism the replay keeps the column linears' inputs as shards, as
the model counts them (:mod:`disagg_llm_tp.sequence_parallel`; it once kept them gathered,
``2·(T - c)·H`` elements per block over the model in the untiled MLP, ``3·(T - c)·H`` in q/k/v's:
:func:`test_a_sequence_parallel_replay_holds_shards`).

Collectives: the tiled run's extra bytes and calls by kind equal :func:`disagg_llm_tp.cost.tile_comm`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiles_cases import RUNS, TILES, tiles_rank

from disagg.testing.dist import run_ranks
from disagg.testing.ranks import loads
from disagg.testing.tolerance import (
    RECIPE_PRECISION,
    assert_params_close,
    assert_scalar_close,
    assert_tensors_close,
    first_grads,
)

pytest.importorskip("disagg_llm_tp")
pytest.importorskip("disagg_vision_sp")


@pytest.fixture(scope="module")
def tiles_case(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from test_offload import case_inputs

    paths, data = case_inputs(tmp_path_factory.mktemp("tiles"))
    per_rank = [loads(b) for b in run_ranks(tiles_rank, 2, paths, data, timeout=1200)]
    return {"ranks": per_rank, "inputs": data}


@pytest.mark.parametrize("layout,precision,recompute", RUNS)
def test_tiles_equal_the_same_layout_without_them_at_every_step(tiles_case, layout, precision, recompute):
    from offload_cases import OPTIM, STEPS

    prec = RECIPE_PRECISION[precision]
    for rank, records in enumerate(tiles_case["ranks"]):
        base = records[(layout, precision, recompute, 1)]
        tiled = records[(layout, precision, recompute, TILES)]
        assert len(base["loss"]) == len(tiled["loss"]) == STEPS
        grads = first_grads(base["grads"])
        # a tied output layer (the tiny Qwen2's lm_head) is the embedding's weight: its gradient
        params = base["params"][0]
        for name in set(params) - set(grads):
            tied = [g for g in grads if g in params and torch.equal(params[g], params[name])]
            if tied:
                grads[name] = grads[tied[0]]
        for step in range(STEPS):
            what = f"{layout} {precision} {recompute} rank {rank} step {step}: "
            assert_scalar_close(tiled["loss"][step], base["loss"][step], what + "loss", prec)
            assert_scalar_close(tiled["norm"][step], base["norm"][step], what + "grad norm", prec)
            assert_tensors_close(tiled["grads"][step], base["grads"][step], what + "grads ", prec)
            assert_params_close(
                tiled["params"][step],
                base["params"][step],
                lr=OPTIM.lr,
                steps=step + 1,
                grads=grads,
                what=what + "params ",
                precision=prec,
                eps=OPTIM.eps,
            )
        # tiles hold less in every microbatch
        for k, (b, t) in enumerate(zip(base["saved"], tiled["saved"])):
            assert t["device"] < b["device"], (layout, precision, recompute, rank, k, b, t)


def _tokens(inputs: dict, mb: int) -> tuple[int, int]:
    """The LLM's padded tokens (longest sample x samples) and samples of microbatch ``mb``."""
    samples = inputs["qwen2"]["samples"]
    idx = [i for i in range(len(samples)) if i % 2 == mb]
    return max(samples[i]["input_ids"].numel() for i in idx) * len(idx), len(idx)


def _model(shape, tokens: int, samples: int, e: int, sp: bool, recompute: str, tiles: int) -> int:
    from disagg.kit.cost.rules import recomputed_activation_bytes
    from disagg_llm_tp import cost

    def count(s) -> int:  # noqa: ANN001
        return cost.activation_bytes(s, tokens, 2, e, sp, 1024, samples, True, tiles)

    if recompute == "none":
        return count(shape)
    return recomputed_activation_bytes(shape, -(-tokens // 2) if sp else tokens, e, count)


@pytest.mark.parametrize("layout,precision,recompute", [r for r in RUNS if r[0].startswith("megatron_tp")])
def test_saved_bytes_fall_by_what_the_model_says(tiles_case, layout, precision, recompute):
    e = 4 if precision == "fp32" else 2
    sp = layout.endswith("-sp")
    for rank, records in enumerate(tiles_case["ranks"]):
        base = records[(layout, precision, recompute, 1)]
        tiled = records[(layout, precision, recompute, TILES)]
        for k, (b, t) in enumerate(zip(base["saved"], tiled["saved"])):
            tokens, samples = _tokens(tiles_case["inputs"], k % 2)
            want = _model(base["shape"], tokens, samples, e, sp, recompute, 1) - _model(
                base["shape"], tokens, samples, e, sp, recompute, TILES
            )
            got = b["device"] - t["device"]
            assert got == want, (layout, precision, recompute, rank, k, got, want)


@pytest.mark.parametrize("precision", sorted({r[1] for r in RUNS if r[0] == "megatron_tp-sp"}))
def test_a_sequence_parallel_replay_holds_shards(tiles_case, precision):
    """Under ``full`` a sequence-parallel block's replay saves the column linears' inputs as shards
    (re-gathered in its backward), as the model counts them. These runs use eager attention (the
    shared cases': dropout through ``F.dropout``), whose saves the model, counting sdpa's, does not
    state: the rest ``r = measured - model`` is the same with and without tiles, and per layer
    (``L = 2``: ``r_none = 2·X + Y``, ``r_full = X + Y``, ``X >= 0`` the layer's attention rest) no
    more under ``full`` than without recompute. A replay that kept the gathered inputs holds
    ``5·(T - c)·H`` elements more (q/k/v's input three times, gate/up's twice as the hooks count
    per save; ``3·(T - c)·H`` with tiles): 19,200 B at ``T`` = 30 in fp32, over ``r_none``."""
    e = 4 if precision == "fp32" else 2
    for rank, records in enumerate(tiles_case["ranks"]):
        rest: dict = {}
        for recompute in ("none", "full"):
            for tiles in (1, TILES):
                run = records[("megatron_tp-sp", precision, recompute, tiles)]
                assert run["shape"].layers == 2
                for k, saved in enumerate(run["saved"]):
                    tokens, samples = _tokens(tiles_case["inputs"], k % 2)
                    want = _model(run["shape"], tokens, samples, e, True, recompute, tiles)
                    rest.setdefault((recompute, k), set()).add(saved["device"] - want)
        for k in range(len(records[("megatron_tp-sp", precision, "none", 1)]["saved"])):
            what = (precision, rank, k, rest[("none", k)], rest[("full", k)])
            assert len(rest[("none", k)]) == len(rest[("full", k)]) == 1, what  # tiles alike
            (r_none,), (r_full,) = rest[("none", k)], rest[("full", k)]
            assert 0 <= r_none - r_full <= r_none, what


@pytest.mark.parametrize("layout,precision,recompute", [r for r in RUNS if r[0].startswith("megatron_tp")])
def test_tiles_collectives_are_predicted(tiles_case, layout, precision, recompute):
    """Over the 3 steps (set-up collectives alike in both runs): the tiled run's extra bytes and
    calls by kind are what :func:`disagg_llm_tp.cost.tile_comm` adds, microbatch by microbatch."""
    from offload_cases import STEPS

    from disagg.interfaces.cost import Workload
    from disagg_llm_tp.cost import tile_comm

    sp = layout.endswith("-sp")
    e = 4 if precision == "fp32" else 2
    for rank, records in enumerate(tiles_case["ranks"]):
        base = records[(layout, precision, recompute, 1)]
        tiled = records[(layout, precision, recompute, TILES)]
        want_bytes: dict[str, int] = {}
        want_calls: dict[str, int] = {}
        for mb in range(2):
            tokens, _ = _tokens(tiles_case["inputs"], mb)
            # the microbatch's padded rows as one sequence (an MLP sees rows, not samples; the
            # model's per-sample shards round up once per sample: exact for one sample)
            w = Workload(2, 1, tokens, 1, 1, e, 0, 0, precision)
            nb, nc = tile_comm(base["shape"], w, sp, recompute, TILES)
            for k, v in nb.items():
                want_bytes[k] = want_bytes.get(k, 0) + STEPS * v
            for k, v in nc.items():
                want_calls[k] = want_calls.get(k, 0) + STEPS * v
        kinds = set(base["comm"]["bytes"]) | set(tiled["comm"]["bytes"])
        got_bytes = {k: tiled["comm"]["bytes"].get(k, 0) - base["comm"]["bytes"].get(k, 0) for k in kinds}
        got_calls = {k: tiled["comm"]["calls"].get(k, 0) - base["comm"]["calls"].get(k, 0) for k in kinds}
        what = (layout, precision, recompute, rank)
        assert {k: v for k, v in got_bytes.items() if v} == want_bytes, what
        assert {k: v for k, v in got_calls.items() if v} == want_calls, what


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from mixed_data import make_mixed_tiny

    return make_mixed_tiny(tmp_path_factory.mktemp("tiny"), "qwen2_5_vl")


def _validate(tiny: dict, out: Path, vision: dict, llm: dict):  # noqa: ANN202
    from mixed_data import mixed_config

    model = {m: {"family": "qwen2_5_vl", "path": tiny["models"]["qwen2_5_vl"]} for m in ("vision", "llm")}
    return mixed_config(model, {"vision": vision, "llm": llm}, tiny, out, 1)


@pytest.mark.parametrize(
    "vision,llm,key,needle",
    [
        (
            {"strategy": "ddp"},
            {"strategy": "zero", "stage": 3, "mlp_tiles": 4},
            "parallel.llm.mlp_tiles",
            "ZeRO-3 gathers parameters",
        ),
    ],
)
def test_config_refuses_tiles_where_they_cannot_run(tiny, tmp_path, vision, llm, key, needle):
    """Before any actor starts, naming the key and what is allowed (bad values and families without
    declared MLPs: ``packages/core/tests/test_config_validate.py``)."""
    from disagg.config.errors import ConfigError

    if llm["strategy"] == "zero":
        pytest.importorskip("disagg_zero")
    with pytest.raises(ConfigError) as err:
        _validate(tiny, tmp_path, vision, llm)
    assert key in str(err.value) and needle in str(err.value), str(err.value)


def test_config_accepts_tiles_on_families_that_declare_their_mlps(tiny, tmp_path):
    sp = {"strategy": "megatron_tp", "degree": 2, "sequence_parallel": True, "mlp_tiles": "auto"}
    _validate(tiny, tmp_path, {"strategy": "ulysses", "degree": 2, "mlp_tiles": 3}, sp)  # no error


def test_a_family_without_declared_mlps_is_refused():
    from disagg.interfaces import LayerMap
    from disagg.kit.recompute import tiled_mlp

    (msg,) = tiled_mlp.mlp_problems(LayerMap(), "toy", "parallel.llm")
    assert "parallel.llm.mlp_tiles" in msg and "LayerMap.mlp" in msg and "allowed: 1" in msg
    with pytest.raises(ValueError, match="declares no per-token MLP"):
        tiled_mlp.apply(torch.nn.Linear(2, 2), LayerMap(), 4, lambda f, *a: f(*a))
