"""Dropout under megatron_tp (tiny Qwen2, attention_dropout 0.25, eager attention).

Masks cannot equal the single-process model's once heads are sharded: HF
draws one mask over all heads from one stream; a TP rank holds only its heads'
attention probabilities and draws their mask from its own (replica, shard)
stream, as Megatron's model-parallel RNG does (drawn from the shared default
stream, heads ``i`` and ``i + h/d`` would be dropped together). So at degree 2
the tests check reproducibility and statistics (kept fraction, independence
of TP ranks and replicas, the expected loss); at degree 1, where nothing is
sharded, the masks, loss and gradients equal Hugging Face's under the same seed.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from dropout_cases import SEED, P, dropout_spy, tp_dropout_rank
from tp_cases import make_batch

from disagg.interfaces import dropout_seed
from disagg.testing.dist import run_ranks
from disagg.testing.ranks import loads as _loads
from disagg.testing.tolerance import assert_scalar_close, assert_tensors_close
from disagg_llm_tp.families.qwen2 import Qwen2Family

DRAWS = 8


@pytest.fixture(scope="module")
def dropout_dir(tmp_path_factory) -> str:
    path = Qwen2Family.make_tiny(tmp_path_factory.mktemp("dropout") / "qwen2", vocab_size=498)
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["attention_dropout"] = P
    cfg_file.write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="module")
def batch(dropout_dir):
    return make_batch(Qwen2Family(dropout_dir), n_samples=4)


def _hf(path: str):
    fam = Qwen2Family(path, {"attn_implementation": "eager"})
    model = fam.build(torch.float32)
    model.train()
    return fam, model


def test_degree_1_equals_hf_mask_for_mask(dropout_dir, batch):
    samples, embeds = batch
    (got,) = [_loads(b) for b in run_ranks(tp_dropout_rank, 1, dropout_dir, 1, 1, samples, embeds, 0)]
    fam, model = _hf(dropout_dir)
    torch.manual_seed(dropout_seed(SEED, 0))  # what core seeds replica 0 with
    leaves = [{k: v.clone().requires_grad_(True) for k, v in e.items()} for e in embeds]
    with dropout_spy() as masks:
        logits, labels = fam.forward(model, samples, leaves)
    loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    loss.backward()

    first = got["first"]
    assert len(first["masks"]) == len(masks) == model.config.num_hidden_layers
    for a, b in zip(first["masks"], masks):
        assert torch.equal(a, b)
    assert_scalar_close(first["loss"], float(loss), "loss")
    ref = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert_tensors_close(got["grads"], ref, "gradient of ")
    for i, (g, e) in enumerate(zip(first["embed_grads"], leaves)):
        assert_tensors_close(g, {k: v.grad for k, v in e.items()}, f"sample {i} input-embedding gradient ")


@pytest.fixture(scope="module")
def tp_run(dropout_dir, batch):
    samples, embeds = batch
    raw = run_ranks(tp_dropout_rank, 4, dropout_dir, 2, 2, samples, embeds, DRAWS)
    return [_loads(b) for b in raw]  # ranks: (replica 0: 0, 1), (replica 1: 2, 3)


def test_same_seed_is_reproducible(tp_run):
    for res in tp_run:
        a, b = res["first"], res["again"]
        assert a["loss"] == b["loss"]
        assert all(torch.equal(x, y) for x, y in zip(a["masks"], b["masks"]))
        for ga, gb in zip(a["embed_grads"], b["embed_grads"]):
            assert all(torch.equal(ga[k], gb[k]) for k in ga)


def test_masks_kept_fraction_and_independence(tp_run):
    for res in tp_run:
        masks = res["first"]["masks"]
        assert len(masks) == 2  # one attention dropout per layer
        kept = torch.cat([m[m >= 0].flatten() for m in masks]).double()
        sigma = math.sqrt(P * (1 - P) / kept.numel())
        assert abs(float(kept.mean()) - (1 - P)) <= 5 * sigma, float(kept.mean())
    # Same shapes on every rank, and every replica has the same samples: only the
    # streams differ. TP ranks of a replica (their heads), replicas (their samples).
    for a, b in ((0, 1), (2, 3), (0, 2), (1, 3)):
        for ma, mb in zip(tp_run[a]["first"]["masks"], tp_run[b]["first"]["masks"]):
            assert ma.shape == mb.shape and not torch.equal(ma, mb), (a, b)
    # The default stream (activations every TP rank holds) stays in step within a replica.
    assert torch.equal(tp_run[0]["first"]["default_rng"], tp_run[1]["first"]["default_rng"])
    assert not torch.equal(tp_run[0]["first"]["default_rng"], tp_run[2]["first"]["default_rng"])
    # TP ranks agree on the loss (their masks together are one mask over all heads).
    assert tp_run[0]["first"]["loss"] == tp_run[1]["first"]["loss"]
    assert tp_run[0]["first"]["loss"] != tp_run[2]["first"]["loss"]


def test_expected_loss_matches_hf(dropout_dir, batch, tp_run):
    """Mean dropout loss over independent draws: TP (two replicas x DRAWS) and
    HF (2 x DRAWS seeds) agree within 4 standard errors."""
    samples, embeds = batch
    tp = torch.tensor([x for r in (0, 2) for x in tp_run[r]["losses"]], dtype=torch.float64)
    fam, model = _hf(dropout_dir)
    hf = []
    with torch.no_grad():
        for i in range(len(tp)):
            torch.manual_seed(1000 + i)
            logits, labels = fam.forward(model, samples, embeds)
            hf.append(float(F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")))
    hf = torch.tensor(hf, dtype=torch.float64)
    assert float(tp.std()) > 0 and float(hf.std()) > 0, "dropout must change the loss"
    se = math.sqrt(float(tp.var()) / len(tp) + float(hf.var()) / len(hf))
    assert abs(float(tp.mean() - hf.mean())) <= 4 * se, (tp.mean(), hf.mean(), se)
