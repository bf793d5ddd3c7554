"""ZeRO 1/2/3 equal the single-process model: losses, merged gradients, grad
norms and parameters after three clipped AdamW steps (two microbatches each),
for the toy LM (loss backward, embedding-input gradients) and the toy encoder
(backward from an external output gradient), fp32 on CPU.

Bounds: the project's tolerance policy (``disagg.testing.tolerance``). Stages 1-2 sum gradients exactly
(``gradient_allreduce_op: sum``) and step torch's AdamW on flat partitions,
elementwise the same arithmetic as the reference. Stage 3 averages, so the
backward seed is scaled by the world size (exact for 2 ranks, one rounding for
3), and reduce-scatter sums in a different order: differences stay ~1e-7.

The 2-rank set also saves each stage's LLM as a sharded checkpoint before its last step
(this rank's pieces of DeepSpeed's partitions, through DCP) and resumes it: in the same
layout bit for bit, and stage 3 into ``ddp`` and back (resharding) within 1e-6.

All configurations of one world size run in one set of ranks (importing
DeepSpeed dominates the cost); the 3-rank set is marked ``slow``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import zero_harness as H

from disagg.testing.dist import run_ranks
from disagg.testing.tolerance import (
    FP32,
    Precision,
    assert_exact,
    assert_params_close,
    assert_scalar_close,
    assert_tensors_close,
)
from disagg.testing.toy import make_toy_dirs

WORLDS = [2, pytest.param(3, marks=pytest.mark.slow)]
#: a resharded resume's next step: 1e-6 relative (issue 26), through the policy
TIGHT = Precision("fp32-1e-6", rtol=1e-6, param_unit=FP32.param_unit)


@pytest.fixture(scope="module")
def toy_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_toy_dirs(tmp_path_factory.mktemp("toy"))


_RUNS: dict[int, Any] = {}


def run(world: int, toy_dirs: tuple[Path, Path], tmp: Path) -> tuple[list[dict], dict, dict]:
    """(per-rank results, LLM reference, encoder reference), computed once per world size."""
    if world not in _RUNS:
        enc, lm = toy_dirs
        ckpt = tmp / f"ckpt{world}" if world == 2 else None
        ranks = H.tensors(run_ranks(H.rank_all, world, enc, lm, world, ckpt, timeout=1500))
        _RUNS[world] = (ranks, H.reference_llm(lm, world), H.reference_encoder(enc, world))
    return _RUNS[world]


def _labels(world: int) -> list[Any]:
    return [
        pytest.param(world, label, marks=pytest.mark.slow) if world == 3 else (world, label)
        for label in H.configs(world)
    ]


CASES = _labels(2) + _labels(3)


@pytest.mark.parametrize("world,label", CASES)
def test_llm_matches_single_process(world: int, label: str, toy_dirs, tmp_path_factory) -> None:
    ranks, ref, _ = run(world, toy_dirs, tmp_path_factory.getbasetemp())
    got = [r[label]["llm"] for r in ranks]
    for step in range(H.STEPS):
        n = H.label_count(H.llm_batches(world)[step])
        loss = sum(r["loss_sum"][step] for r in got) / n
        assert_scalar_close(loss, ref["loss"][step], f"step {step} loss")
        for r in got:  # every rank reports the same group norm
            assert_scalar_close(r["norm"][step], ref["norm"][step], f"step {step} grad norm")
            assert_tensors_close(r["grads"][step], ref["grads"][step], f"step {step} grad ")
        # embedding-input gradients, each sample from the rank that ran it
        for i, want in enumerate(ref["embed_grads"][step]):
            have = got[i % world]["embed_grads"][step][i]
            assert_tensors_close(have, want, f"step {step} sample {i} input grad ")
    for r in got:
        H.assert_params_match(r["params"], ref, "params after 3 steps ")
        assert r["lr"] == pytest.approx(ref["lr"], rel=1e-12)


@pytest.mark.parametrize("world,label", CASES)
def test_encoder_from_external_gradient_matches(world: int, label: str, toy_dirs, tmp_path_factory) -> None:
    ranks, _, ref = run(world, toy_dirs, tmp_path_factory.getbasetemp())
    for r in (x[label]["encoder"] for x in ranks):
        for step in range(H.STEPS):
            assert_scalar_close(r["norm"][step], ref["norm"][step], f"step {step} grad norm")
            assert_tensors_close(r["grads"][step], ref["grads"][step], f"step {step} grad ")
        H.assert_params_match(r["params"], ref, "params after 3 steps ")


@pytest.mark.parametrize("label", ["2", "3"])
def test_checkpoint_roundtrip_resumes_exactly(label: str, toy_dirs, tmp_path_factory) -> None:
    ranks, _, _ = run(2, toy_dirs, tmp_path_factory.getbasetemp())
    for r in (x[label]["checkpoint"] for x in ranks):
        assert_exact(r["loaded"], r["saved"], what="loaded params ")
        # the 3rd step after loading equals the uninterrupted one: optimizer
        # moments and scheduler position came back too
        assert_exact(r["after_b"], r["after_a"], what="resumed step ")
        assert r["lr_b"] == r["lr_a"] and r["lr_loaded"] != r["lr_b"]


@pytest.mark.parametrize("label", ["1", "2", "3"])
def test_sharded_checkpoint_holds_each_ranks_pieces_and_resumes(label, toy_dirs, tmp_path_factory) -> None:
    """``checkpoint.format: sharded`` under zero (issue 26 item 2): the LLM saves its pieces
    (``sharded_state``: DeepSpeed's partitions of the fp32 masters and AdamW state) before its
    3rd step through DCP; each rank's file holds half of the group's state (every element in
    one file), and a load reads only this rank's pieces. A fresh group of the same layout
    resumes bit for bit (state after the load, and after the same 3rd step), and so does the
    full form (``checkpoint.format: full``: ``load_full_state``) loaded over it. Stage 3 also
    reshards both ways: ``ddp`` loads the state exactly and its 3rd step's gradients and
    parameters equal zero-3's within 1e-6; ddp's save loads into zero-3 exactly, and both
    take a 4th step alike."""
    from disagg.kit.checkpoint import payload_by_file

    base = tmp_path_factory.getbasetemp()
    ranks, _, _ = run(2, toy_dirs, base)
    got = [r[label]["llm"]["sharded"] for r in ranks]
    saved = got[0]["saved"]
    assert {k.rpartition("/")[2] for k in saved if k.startswith("optim/")} == {
        "exp_avg",
        "exp_avg_sq",
        "step",
    }
    state = sum(v.numel() * v.element_size() for v in saved.values())
    payload = payload_by_file(H.sharded_ckpt(base / "ckpt2", label))
    assert sorted(payload) == ["__0_0.distcp", "__1_0.distcp"] and sum(payload.values()) == state, payload
    for rank, r in enumerate(got):
        mine = payload[f"__{rank}_0.distcp"]
        assert abs(mine / state - 0.5) < 0.01, (rank, mine, state)
        assert mine <= r["file"]  # the file: its pieces plus DCP's per-item headers
        # its own pieces (the step scalars, written once, are read by every rank)
        steps = sum(v.numel() * v.element_size() for k, v in saved.items() if k.endswith("/step"))
        assert mine <= r["read"] <= mine + steps, (rank, r["read"], mine)
        assert_exact(r["saved"], saved, f"rank {rank} merged state: ")
        assert_exact(r["loaded"], saved, f"zero {label}, rank {rank}, loaded: ")
        assert_exact(r["resumed"], r["uninterrupted"], f"zero {label}, rank {rank}, resumed step: ")
        # the full form (checkpoint.format: full) into the stepped group: the same, exactly
        assert_exact(r["full/loaded"], saved, f"zero {label} full form, rank {rank}, loaded: ")
        assert_exact(r["full/resumed"], r["uninterrupted"], f"zero {label} full form, rank {rank}, resumed: ")
        assert r["lr"][0] == r["lr"][1]
        if label != "3":
            continue
        assert_exact(r["ddp/loaded"], saved, f"zero 3 -> ddp, rank {rank}, loaded: ")
        assert_exact(r["ddp->zero/loaded"], r["ddp/stepped"], f"ddp -> zero 3, rank {rank}, loaded: ")
        pairs = {
            "zero 3 -> ddp, step 3": (r["ddp/stepped"], r["uninterrupted"]),
            "ddp -> zero 3, step 4": (r["ddp->zero/stepped"], r["ddp/stepped4"]),
        }
        for k, (what, (have, want)) in enumerate(pairs.items()):
            grads = r["grads"]["ddp"][k]
            assert_tensors_close(r["grads"]["zero"][k], grads, f"{what}, rank {rank}, grad ", TIGHT)
            params = {n[6:]: v for n, v in have.items() if n.startswith("param/")}
            ref = {n[6:]: v for n, v in want.items() if n.startswith("param/")}
            assert_params_close(
                params,
                ref,
                lr=H.OPTIM.lr,
                steps=1,
                grads=grads,
                what=f"{what}, rank {rank}: ",
                precision=TIGHT,
                betas=H.OPTIM.betas,
            )


@pytest.mark.parametrize("world,label", [c for c in CASES if "offload" not in str(c)])
def test_state_and_comm_accounting_match_the_analytic_model(world, label, toy_dirs, tmp_path_factory) -> None:
    """What ``zero`` reports per step (the bench's figures) equals core's cost
    formulas (:func:`zero_harness.assert_accounting`), with the encoder
    gathered twice per microbatch and the LLM once."""
    from disagg.testing.toy import ToyEncoderFamily, ToyLMFamily

    ranks, _, _ = run(world, toy_dirs, tmp_path_factory.getbasetemp())
    # stage 3, per step and rank: the toy encoder calls its root once per item (3 per step:
    # a 1-item and a 2-item sample, one per microbatch), each module fetched forward and
    # backward (its first, fed by data, once per microbatch's backward: cost.zero3_uses), one
    # vote per call and one per microbatch; the toy LM one sample per microbatch, every module
    # (its per-sample embedding too) fetched forward and backward, two agreements
    from disagg_zero.cost import module_of

    families = {"encoder": (ToyEncoderFamily, toy_dirs[0]), "llm": (ToyLMFamily, toy_dirs[1])}
    for role, (family, path) in families.items():
        named = [(n, tuple(p.shape)) for n, p in family(path).build().named_parameters()]
        if role == "encoder":
            first = module_of(named[0][0])
            uses = [3 + H.MICROBATCHES if module_of(n) == first else 2 * 3 for n, _ in named]
            votes = 3 + H.MICROBATCHES
        else:
            uses, votes = [2 * H.MICROBATCHES] * len(named), 2 * H.MICROBATCHES
        for r in (x[label][role] for x in ranks):
            # stage 3 partitions every tensor here (H.PER_LAYER: threshold 0)
            mbs = [H.MICROBATCHES] * H.STEPS
            H.assert_accounting(r, named, int(label), world, mbs, 0, [uses] * H.STEPS, [votes] * H.STEPS)
