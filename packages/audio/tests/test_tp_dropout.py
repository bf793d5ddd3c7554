"""Dropout between ``fc1`` and ``fc2`` under ``megatron_tp`` 2 (tiny Whisper, activation
dropout 0.5, hidden dropout 0.1): the column-split activations draw a mask per TP rank,
as attention probabilities do (llm-tp's ``rng.py``), so feature ``j`` and ``j + ffn/2``
are not dropped together; the dropouts on activations every TP rank holds whole draw the
same masks on both ranks (or the residual stream they hold whole would diverge); and
``recompute: full`` replays the same masks (the gradients equal ``none``'s bit for bit)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from dropout_ranks import tp_dropout_rank
from harness import ragged_clips, upstream_grads

from disagg.testing.dist import run_ranks
from disagg.testing.ranks import loads
from disagg.testing.tolerance import assert_exact
from disagg_audio.families.whisper import WhisperAudioFamily

P = 0.5
OPTIONS = {"hidden_size": 24, "attn_implementation": "eager"}


@pytest.fixture(scope="module")
def dropout_whisper(tiny_whisper, tmp_path_factory):
    path = tmp_path_factory.mktemp("dropout") / "whisper"
    shutil.copytree(tiny_whisper, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(activation_dropout=P, dropout=0.1, attention_dropout=0.0)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_activation_dropout_draws_per_tp_rank(dropout_whisper):
    pytest.importorskip("disagg_llm_tp")
    family = WhisperAudioFamily(dropout_whisper, OPTIONS)
    inputs = [family.preprocess(items) for items in ragged_clips([[2.3], [0.7, 0.45]])]
    grads = upstream_grads(family, inputs)
    runs = run_ranks(tp_dropout_rank, 2, str(dropout_whisper), 2, OPTIONS, inputs, grads)
    both = [loads(r) for r in runs]
    layers = int(json.loads((dropout_whisper / "config.json").read_text())["encoder_layers"])
    windows = sum(int(x["positions"].numel()) for x in inputs)
    for r in both:
        # backward replays each layer's three masks (after attention, between fc1 and fc2, after
        # fc2) per window, not the embedding dropout before the layers
        assert r["none"]["replayed"] == 0 and r["full"]["replayed"] == 3 * layers * windows
        none, full = r["none"]["grads"], r["full"]["grads"]
        assert sorted(none) == sorted(full) and none
        for name, g in none.items():
            assert_exact(full[name], g, f"{name}: gradient under recompute full vs none")
    r0, r1 = (r["none"] for r in both)
    assert len(r0["activation"]) == len(r1["activation"]) == layers * windows > 0
    assert len(r0["shared"]) == len(r1["shared"]) > 0
    for a, b in zip(r0["shared"], r1["shared"]):
        assert_exact(a, b, "a mask on activations both TP ranks hold whole")
    m0 = torch.cat([m.flatten() for m in r0["activation"]])
    m1 = torch.cat([m.flatten() for m in r1["activation"]])
    live = (m0 >= 0) & (m1 >= 0)
    assert int(live.sum()) > 2000
    # each rank keeps about 1 - p; a shared mask would agree everywhere, independent ones
    # about p^2 + (1-p)^2 = 0.5 of the time
    for m in (m0, m1):
        assert abs(float(m[live].float().mean()) - (1 - P)) < 0.05
    agree = float((m0[live] == m1[live]).float().mean())
    assert abs(agree - (P**2 + (1 - P) ** 2)) < 0.05, agree
