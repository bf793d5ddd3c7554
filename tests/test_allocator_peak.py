"""The memory model's peak per rank (:mod:`disagg.kit.cost.memory`'s allocator-served terms:
state + gathered + saved activations + the transient, each strategy's own ``estimate`` through
:func:`disagg.plan.extended.extended_cost`, the planner's path) against the peak of live CPU
allocations PyTorch's allocator records during one real step (:mod:`disagg.testing.allocator`:
``torch.profiler``'s memory records summed in time order), for ``ddp``, ``ulysses``,
``megatron_tp`` and ``zero`` on 2 gloo ranks of the tiny Qwen2.5-VL: one spawn, every strategy
in it (``alloc_cases``).

The measured peak includes the state: the trace begins before the strategy is built, so what
the step finds live (weights, AdamW's moments, fp32 masters) is counted like the prediction's
``state`` term; ``baseline`` (live when the second step begins) is kept beside it in the report.
The second step is measured: the first creates the moments, as every later step finds them.

Why the ratio is not 1, and the bound (:data:`LOW` <= measured / predicted <= :data:`HIGH`):

- the model adds its terms as if all were live at once: all gradients beside all saved
  activations, plus one block's transient (its recompute term, charged whatever the recompute
  mode); a real step frees saved activations while the gradients appear, and with no recompute
  has no replayed block. So measured <= predicted, up to what the model leaves out at tiny scale
  (autograd's and AdamW's scalars, the CPU kernels' short-lived temporaries):
  :data:`HIGH` = 1.05. Above it a term is missing (``zero`` is: below).
- the peak holds at least the state less its gradients (set to None after each step) plus every
  saved activation (the end of the forward); at the tiny sizes that is 0.70-0.78 of the model's
  sum: :data:`LOW` = 0.6 (measured: below). Below it the model
  counts a term the rank does not hold.

``ddp``'s replicas' gradient all-reduce (:mod:`disagg.kit.grads`) flattens a bucket
(``BUCKET_BYTES``, 25 MiB, or all the gradients if fewer) into one buffer, which may be live at the
activations' peak or not, by timing (``ddp`` llm measured 0.85 and 1.22 of the prediction without
it in two runs; the peaks differ by exactly the gradients' bytes). ``ddp_cost`` counts it in its
``buffers`` term (``Cost.buffer_bytes``, :func:`disagg.builtin.ddp_cost.grad_bucket_bytes`);
:func:`test_ddp_buffers_term_is_its_gradient_bucket` checks the term against the bucket by hand.

Measured on torch 2.13 CPU, 2 gloo ranks (busiest rank of each group, measured / predicted):
ddp vision 0.74, ulysses 0.82-0.84, ddp llm 0.76-0.87, megatron_tp 0.67-0.71 (three runs).
``zero`` (stage 3) measured ~430x and ~1060x while ``disagg_zero.cost`` left out the gradient
reduce bucket DeepSpeed's ZeRO-3 optimizer allocates at set-up (``stage3.py``:
``torch.empty(reduce_bucket_size)`` per communication dtype when ``contiguous_gradients``), 5e8
elements by default: 2 GB per rank in fp32 (and under ``bf16``, whose gradients are reduced in
fp32), 1 GB under ``bf16-pure``. The estimate counts it now (``Cost.buffer_bytes``, the allocator
view's ``buffers`` term, from the config ``disagg_zero.dsconfig`` builds): ``zero`` is checked in
:func:`test_allocator_peak_within_bound` like every strategy, and, since the 2 GB swamp every other
term there, once more with the bucket taken off both sides
(:func:`test_zero_within_bound_without_its_reduce_bucket`: 0.75-0.76 vision, 0.77-0.85 llm).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")
pytest.importorskip("disagg_zero")

import alloc_cases as C  # noqa: E402
import flops_cases as F  # noqa: E402

#: measured / predicted bounds (the module docstring says why)
LOW, HIGH = 0.6, 1.05
#: DeepSpeed ZeRO-3's gradient reduce bucket (elements: its default reduce_bucket_size) x fp32,
#: by hand: what ``zero``'s ``buffers`` term must be here
ZERO3_BUCKET = 500_000_000 * 4


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    from disagg.plugins import get_registry
    from disagg.testing.dist import run_ranks

    path = str(get_registry().family("encoder", F.FAMILY).make_tiny(tmp_path_factory.mktemp("tiny") / "vlm"))
    return path, run_ranks(C.rank_peaks, 2, path, timeout=1200)


def _shapes(path: str):
    from disagg.cost.shapes import shapes_for

    cfg = json.loads((Path(path) / "config.json").read_text())
    return shapes_for({"vision": cfg, "llm": cfg}, {"vision": F.FAMILY, "llm": F.FAMILY})


def predicted_terms(shape, case: tuple, lengths: list[int]) -> dict[str, int]:
    """The memory model's allocator-served terms for one rank holding samples of ``lengths``
    tokens under ``case``: state, gathered, saved (summed over its samples) and the transient."""
    from disagg.cost import predict
    from disagg.plan.extended import extended_cost

    name, _, degree, replicas, options = case

    def ask(**q):
        return predict(q.pop("shape"), name, precision="fp32", **q)

    terms = {"state": 0, "gathered": 0, "saved": 0, "transient": 0, "buffers": 0}
    for n in lengths:
        g = extended_cost(
            ask, shape, None, degree, replicas, n, "fp32", replicas, 1, dict(options), "none", None
        )
        assert g is not None
        m = g.memory
        terms["state"], terms["gathered"], terms["buffers"] = m.state, m.gathered, m.buffers
        terms["saved"] += m.saved
        terms["transient"] = max(terms["transient"], m.transient)
    return terms


def ratios(
    path: str, ranks: list, drop: str | None = None, bare: bool = False
) -> dict[tuple[str, str], dict]:
    """Per case, the busiest rank's measured peak / predicted peak (``drop``: a term left out
    of the prediction, the fault the bound must see; ``bare``: the predicted ``buffers`` term
    taken off the measured peak and out of the prediction, so that the rest is compared)."""
    shapes = _shapes(path)
    images = [int(x["image_grid_thw"].prod()) for x in F.vision_inputs(path)]
    samples, _ = F.llm_inputs(path)
    lengths = {"vision": images, "llm": [len(s["input_ids"]) for s in samples]}
    out = {}
    for k, case in enumerate(C.CASES):
        name, module = case[0], case[1]
        worst = None
        for r in ranks:
            got = r[k]
            assert tuple(got["case"]) == tuple(case[:4]) and got["records"] > 0, got
            ns = [lengths[module][i] for i in got["samples"]]
            if name == "megatron_tp":
                ns = [max(lengths[module])] * len(ns)  # one microbatch, padded to its longest
            terms = predicted_terms(shapes[module], case, ns)
            if drop:
                terms[drop] = 0
            peak = got["peak"]
            if bare:
                peak -= terms["buffers"]
                terms["buffers"] = 0
            ratio = peak / sum(terms.values())
            row = {"ratio": ratio, "peak": got["peak"], "baseline": got["baseline"], **terms}
            if worst is None or abs(ratio - 1) > abs(worst["ratio"] - 1):
                worst = row
        out[(name, module)] = worst
    return out


def test_allocator_peak_within_bound(measured):
    """Every strategy (``zero`` with its reduce bucket): measured / predicted within the bound,
    per group's busiest rank."""
    path, ranks = measured
    got = ratios(path, ranks)
    assert len(got) == len(C.CASES)
    outside = {k: v for k, v in got.items() if not LOW <= v["ratio"] <= HIGH}
    assert len(got) == 6 and not outside, outside
    print({f"{s}/{m}": round(v["ratio"], 3) for (s, m), v in got.items()})  # for the report


def test_zero_within_bound_without_its_reduce_bucket(measured):
    """``zero`` stage 3: its ``buffers`` term is DeepSpeed's default reduce bucket (by hand,
    :data:`ZERO3_BUCKET`), and with it taken off both sides the
    rest of the prediction is within the bound too (the 2 GB alone would put any prediction near
    1)."""
    path, ranks = measured
    plain = ratios(path, ranks)
    bare = ratios(path, ranks, bare=True)
    zero = [k for k in plain if k[0] == "zero"]
    assert len(zero) == 2
    assert all(v["buffers"] == ZERO3_BUCKET for k, v in plain.items() if k[0] == "zero"), plain
    for k in zero:
        assert LOW <= bare[k]["ratio"] <= HIGH, bare[k]
    print({f"{s}/{m}": round(bare[(s, m)]["ratio"], 4) for s, m in zero})  # for the report


def test_ddp_buffers_term_is_its_gradient_bucket(measured):
    """``ddp``'s ``buffers`` term on 2 replicas is the flat all-reduce bucket by hand: 4 B (fp32)
    per element of the module's weights as HF loads them (fewer than ``BUCKET_BYTES``, so one
    bucket of all the gradients), what the test added itself before ``ddp_cost`` counted it."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from disagg.kit.grads.buckets import BUCKET_BYTES

    path, ranks = measured
    got = ratios(path, ranks)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    vision = sum(p.numel() for p in model.model.visual.parameters())
    elements = {"vision": vision, "llm": sum(p.numel() for p in model.parameters()) - vision}
    for m, n in elements.items():
        assert 0 < 4 * n < BUCKET_BYTES
        assert got[("ddp", m)]["buffers"] == 4 * n, (m, got[("ddp", m)], n)


def test_a_dropped_term_fails(measured):
    """The fault the bound must see: a prediction without its saved activations is out of bound
    for every strategy (``zero``'s bucket taken off both sides, as above)."""
    path, ranks = measured
    got = ratios(path, ranks, drop="saved", bare=True)
    assert all(not LOW <= v["ratio"] <= HIGH for v in got.values()), got


def test_trace_sees_a_known_sequence():
    """The trace (and the profiler names it reads) on allocations of known sizes: 4000 B live
    before the window, 8000 + 8000 B at once inside it, then 8000 freed and 2000 allocated."""
    import torch

    from disagg.testing.allocator import trace

    def step(a: torch.Tensor) -> None:
        b = torch.empty(2000)
        c = torch.empty(2000)
        del b
        d = torch.empty(500)
        del c, d

    _, peak = trace(lambda: torch.empty(1000), step)
    assert (peak.baseline, peak.peak, peak.records) == (4000, 20000, 6)
