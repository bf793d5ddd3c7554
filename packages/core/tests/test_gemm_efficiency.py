"""Compute time by GEMM shape (issue 24 item 2): the efficiency curve is monotone in a
matmul's arithmetic intensity and bounded by its ceiling, a TP-split narrow matmul is
charged more time per FLOP than the unsplit one, the strategies' shape lists add up to
their FLOPs, TP without sequence parallelism repeats the norms on every rank, and
``--calibrate`` fits the curve to a sweep of measured shapes and writes its parameters.
Pure computation; the calibration's measurements are replaced by a known curve."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from disagg.interfaces.compute import AttentionCore, Compute, Gemm
from disagg.plan.cluster import PRESETS, cluster_from
from disagg.plan.efficiency import (
    attention_efficiency,
    compute_seconds,
    efficiency,
    flat,
    gemm_seconds,
    intensity,
    work_seconds,
)

H100 = PRESETS["h100x8"]


def test_curve_is_monotone_in_intensity_and_bounded():
    # square products of growing size: intensity grows, efficiency never falls, never passes the ceiling
    effs = [efficiency(n, n, n, H100) for n in (128, 256, 512, 1024, 2048, 4096, 8192)]
    assert effs == sorted(effs) and effs[-1] == pytest.approx(H100.mfu)
    # one narrow dimension of growing width, tile-aligned (quantization 1): monotone too
    narrow = [efficiency(8192, 8192, k, H100) for k in (16, 32, 64, 128, 256, 512, 1024, 4096)]
    assert narrow == sorted(narrow) and narrow[0] < 0.1 * H100.mfu
    # bounded for any shape, and positive
    for m, n, k in [(1, 1, 1), (7, 3000, 5), (16384, 432, 1280), (100000, 100000, 100000)]:
        assert 0 < efficiency(m, n, k, H100) <= H100.mfu
    # without the curve every product runs at the ceiling
    assert efficiency(16384, 1280, 160, flat(H100)) == H100.mfu
    # below the ridge, efficiency is the memory bound: rate = bandwidth x intensity
    i = intensity(8192, 8192, 16, 2)
    assert i < H100.gemm_ridge
    assert efficiency(8192, 8192, 16, H100) * H100.peak_flops == pytest.approx(H100.mem_bw * i)


def test_tp_split_narrow_gemm_costs_more_per_flop():
    """The 1280-wide tower's attention projection split 8 ways by TP (k = 160, a row-parallel
    layer) against the same FLOPs on 1/8 of the tokens at full width (Ulysses)."""
    n, h, d = 16384, 1280, 8
    tp = Gemm(n, h, h // d)
    ulysses = Gemm(n // d, h, h)
    assert tp.flops == ulysses.flops
    assert gemm_seconds(tp, H100, 2) > 1.5 * gemm_seconds(ulysses, H100, 2)
    # and a column split leaves 432 of an MLP's 3456 columns: a partial 128-wide tile
    col = efficiency(n, 3456 // d, h, H100)
    assert col < efficiency(n // d, 3456, h, H100)
    # few heads per rank: an attention core of 2 heads fills fewer units than one of 16
    few = attention_efficiency(AttentionCore(1024, 1024, 80, 2), H100)
    many = attention_efficiency(AttentionCore(1024, 1024, 80, 16), H100)
    assert few < many <= H100.mfu


def _published():
    pytest.importorskip("disagg_vision_sp")
    pytest.importorskip("disagg_llm_tp")
    from disagg.bench.published import QWEN2_5_VL_32B
    from disagg.plan.published import published_shapes

    return published_shapes(QWEN2_5_VL_32B)


def test_shape_lists_add_up_to_the_flops_and_split_elementwise_by_layout():
    pytest.importorskip("disagg_zero")
    from disagg.cost import predict

    shapes = _published()
    vision, llm = shapes["vision"], shapes["llm"]
    n = 16384
    kw = {"samples": 2, "microbatches": 2}
    ddp_v = predict(vision, "ddp", 1, 1, n, "bf16", **kw)
    ddp_l = predict(llm, "ddp", 1, 1, n // 4 + 512, "bf16", **kw)
    # a whole replica: the shapes' FLOPs are the module's FLOPs (every weight, every attention window)
    for c in (ddp_v, ddp_l):
        assert c.compute is not None and c.compute.flops == pytest.approx(c.flops, rel=1e-9)
    uly = predict(vision, "ulysses", 8, 1, n, "bf16", **kw)
    tp = predict(vision, "megatron_tp", 8, 1, n, "bf16", **kw)
    sp = predict(vision, "megatron_tp", 8, 1, n, "bf16", options={"sequence_parallel": True}, **kw)
    assert uly.compute.flops == pytest.approx(ddp_v.flops / 8, rel=1e-9)
    # TP keeps the replicated patch embedding whole on every rank: a little more than 1/8
    assert ddp_v.flops / 8 < tp.compute.flops < 1.02 * ddp_v.flops / 8
    # element-wise work: ulysses splits all of it by tokens, TP the width-wise part only,
    # TP with sequence parallelism all of it
    ew = {k: c.compute.elementwise_bytes for k, c in (("ddp", ddp_v), ("uly", uly), ("tp", tp), ("sp", sp))}
    assert ew["uly"] == pytest.approx(ew["ddp"] / 8) and ew["sp"] == pytest.approx(ew["ddp"] / 8)
    assert ew["tp"] > 3 * ew["uly"]
    # recompute: full replays the forward (4/3 of everything), selective the attention cores
    full = predict(vision, "ulysses", 8, 1, n, "bf16", recompute="full", **kw)
    assert full.compute.flops == pytest.approx(4 / 3 * uly.compute.flops)
    sel = predict(vision, "ulysses", 8, 1, n, "bf16", recompute="selective", **kw)
    assert sel.compute.flops == pytest.approx(sel.flops, rel=1e-9)
    assert sel.compute.elementwise_bytes == uly.compute.elementwise_bytes
    # compute time: the TP tower takes longer than the ulysses one for the same FLOPs per rank
    assert compute_seconds(tp, H100) > compute_seconds(uly, H100)
    # the flat model is FLOPs at the MFU, whatever the shapes
    assert compute_seconds(tp, flat(H100, 0.4)) == tp.flops / (H100.peak_flops * 0.4)


def test_a_cost_without_shapes_is_charged_its_flops_at_the_ceiling():
    from disagg.interfaces import Cost

    c = Cost(0, 0, {}, 0, 1e15)
    assert compute_seconds(c, H100) == 1e15 / (H100.peak_flops * H100.mfu)
    work = Compute(gemms=(Gemm(4096, 4096, 4096, 3.0),), elementwise_bytes=1e9, elem_bytes=2)
    with_shapes = replace(c, compute=work)
    assert compute_seconds(with_shapes, H100) == pytest.approx(
        work.flops / (H100.peak_flops * H100.mfu) + 1e9 / H100.mem_bw
    )
    assert work_seconds(work, H100) == compute_seconds(with_shapes, H100)


def _known_rate(m: int, n: int, k: int, r: float = 30e9, ridge: float = 12.0) -> float:
    return r * min(1.0, intensity(m, n, k, 4) / ridge)


def test_fit_recovers_a_known_curve():
    from disagg.plan.calibrate import GEMM_SWEEP, fit_curve

    samples = [(m, n, k, _known_rate(m, n, k)) for m, n, k in GEMM_SWEEP]
    assert fit_curve(samples) == (pytest.approx(30e9, rel=1e-9), pytest.approx(12.0, rel=1e-9))
    # flat data: no memory bound
    assert fit_curve([(m, n, k, 5e9) for m, n, k in GEMM_SWEEP]) == (pytest.approx(5e9), 0.0)
    with pytest.raises(ValueError, match="no measurement"):
        fit_curve([])


def test_calibrate_writes_the_fitted_curve(tmp_path, monkeypatch):
    """``disagg plan --calibrate FILE``: the sweep's fit lands in FILE (a known curve stands in
    for the measurements, so the figures are exact), and the plan is charged by it."""
    pytest.importorskip("disagg_vision_sp")
    pytest.importorskip("disagg_llm_tp")
    import yaml

    from disagg.cli.main import main
    from disagg.plan import calibrate as cal
    from disagg.plan.cluster import load_cluster

    monkeypatch.setattr(cal, "gemm_rate", lambda m, n, k, repeats=5: _known_rate(m, n, k))
    monkeypatch.setattr(cal, "layer_overhead", lambda: 1e-4)
    monkeypatch.setattr(cal, "gloo_alpha_beta", lambda: (2e-5, 2e9))
    monkeypatch.setattr(cal, "stream_bandwidth", lambda: 7e9)
    from disagg.bench.published import QWEN2_5_VL_32B

    small = {**json.loads(json.dumps(QWEN2_5_VL_32B)), "model_type": "qwen2_5_vl"}
    small["vision_config"].update(depth=2, hidden_size=64, intermediate_size=128, num_heads=4,
                                  out_hidden_size=96, fullatt_block_indexes=[1])  # fmt: skip
    small["text_config"].update(hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)  # fmt: skip
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(small))
    cfg = tmp_path / "config.yaml"
    model = {m: {"family": "qwen2_5_vl", "path": str(d)} for m in ("vision", "llm")}
    cfg.write_text(yaml.safe_dump({"model": model, "output_dir": str(tmp_path / "run")}))
    out, plan_json = tmp_path / "cpu.json", tmp_path / "plan.json"
    argv = ["plan", str(cfg), "--calibrate", str(out), "--gpus", "2", "--samples", "2",
            "--vision-tokens", "256", "--text-tokens", "32", "--json", str(plan_json)]  # fmt: skip
    assert main(argv) == 0
    c = load_cluster(out)
    assert c.peak_flops == pytest.approx(30e9, rel=1e-6) and c.mfu == 1.0
    assert c.mem_bw == 7e9 and (c.gemm_tile, c.compute_units) == (0, 0)
    assert 0 < c.gemm_ridge <= 12.0 + 1e-9
    # "ray call" joins the list when the session's Ray is already up (calibrate measures it then)
    assert c.source.startswith("measured (matmul, layer, gloo, gemm curve, memory")
    assert cluster_from(str(out)) == c
    # plan.json: per group, the predicted busy seconds (metrics.jsonl's name) and their parts
    best = json.loads(plan_json.read_text())["ranked"][0]
    for g in best["groups"].values():
        assert "time_s" not in g
        assert g["busy_s"] == pytest.approx(sum(g["busy_s_by_part"].values()))
        assert set(g["busy_s_by_part"]) == {"compute_s", "collective_s", "overhead_s", "transfer_s"}
    assert math.isfinite(best["step_time_s"]) and best["step_time_s"] > 0


def test_curve_flags_and_their_errors():
    from disagg.plan.efficiency import shaped

    c = cluster_from(
        "h100x8", {"mem_bw": "2TB/s", "gemm_ridge": "100", "gemm_tile": "64", "compute_units": "114"}
    )
    assert (c.mem_bw, c.gemm_ridge, c.gemm_tile, c.compute_units) == (2e12, 100.0, 64, 114)
    off = cluster_from("h100x8", {"mem_bw": 0, "gemm_ridge": 0, "gemm_tile": 0, "compute_units": 0})
    assert not shaped(off) and efficiency(16384, 1280, 160, off) == off.mfu
    with pytest.raises(ValueError, match="--gemm-tile: 'x' is not a number"):
        cluster_from("h100x8", {"gemm_tile": "x"})
    with pytest.raises(ValueError, match=r"mfu must be in \(0, 1\]"):
        cluster_from("h100x8", {"mfu": "0"})
    with pytest.raises(ValueError, match="mem_bw >= 0"):
        cluster_from("h100x8", {"gemm_ridge": "-1"})
