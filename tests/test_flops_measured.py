"""Per-group ``flops`` of ``metrics.jsonl`` (:mod:`disagg.metrics.flops`, the count every
first-party cost hook states) against the FLOPs PyTorch counts while the ranks run
(``torch.utils.flop_counter.FlopCounterMode`` over each rank's forward and backward of a step,
``flops_cases``), for ``ddp``, ``ulysses``, ``megatron_tp`` and ``zero`` on 2 gloo ranks of the
tiny Qwen2.5-VL: one spawn, every strategy in it.

The model and the counter differ by terms stated here, each applied exactly (none is a slack):

- the vision tower's first product (the patch embedding's convolution) has no input gradient (the
  pixels need none): the model counts 3 passes of every product, the rank runs 2 of this one;
- the LLM's output layer runs on every row but the last (no next token to predict there);
- attention cores: PyTorch's SDPA formulas count a causal kernel as a full one (the model counts
  the causal half) and its backward as 2.5 forwards (the flash kernel recomputes ``QKᵀ``; the
  model counts 2): measured = model x (1 + 2.5) / 3, x 2 for the causal decoder. Torch 2.13 has
  no formula for the CPU SDPA kernel; ``flops_cases.count_cpu_attention`` gives it PyTorch's own;
- ``megatron_tp`` pads a microbatch to its longest sequence: the ranks compute the padding too,
  which ``flops`` (useful work) leaves out; the comparison counts each sample at the padded length.

Left for the bound (``REL``, 0.2%): the vocabulary padded to a multiple of the TP degree.
Element-wise work (norms, softmax, activations) is in neither count: FlopCounterMode counts
matmuls, convolutions and attention only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("disagg_vision_sp")
pytest.importorskip("disagg_llm_tp")
pytest.importorskip("disagg_zero")

import flops_cases as C  # noqa: E402

#: the bound on measured / expected - 1 (what the docstring leaves to it)
REL = 2e-3


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    from disagg.plugins import get_registry
    from disagg.testing.dist import run_ranks

    path = str(get_registry().family("encoder", C.FAMILY).make_tiny(tmp_path_factory.mktemp("tiny") / "vlm"))
    return path, run_ranks(C.rank_flops, 2, path, timeout=1200)


def _shapes(path: str):
    from disagg.cost.shapes import shapes_for

    cfg = json.loads((Path(path) / "config.json").read_text())
    return shapes_for({"vision": cfg, "llm": cfg}, {"vision": C.FAMILY, "llm": C.FAMILY})


def expected_counted(shape, n: int) -> float:
    """What FlopCounterMode counts for one sample of ``n`` tokens, from the model's
    :func:`~disagg.metrics.flops.sample_flops` and the differences the module docstring states."""
    from disagg.interfaces.shapes import EncoderShape
    from disagg.kit.cost.rules import extra_flops
    from disagg.metrics.flops import sample_flops

    attention = extra_flops(shape, n, 0.0, "selective")  # the model's attention cores, one forward
    dense = sample_flops(shape, n) - 3 * attention
    if isinstance(shape, EncoderShape):
        first = shape.tensors()[0]
        assert first.name == "patch_embed.proj.weight"
        dense -= 2 * first.matmul_rows(n) * first.numel  # no input gradient
        return dense + attention * 3.5
    dense -= 3 * 2 * shape.hidden * shape.vocab  # no output row for the last token
    return dense + attention * 3.5 * 2


def test_group_flops_equal_flop_counter(measured):
    from disagg.interfaces.shapes import EncoderShape
    from disagg.metrics.flops import ModuleFlops, StepFlops, sample_flops

    path, ranks = measured
    shapes = _shapes(path)
    images = [int(x["image_grid_thw"].prod()) for x in C.vision_inputs(path)]
    samples, _ = C.llm_inputs(path)
    lengths = {"vision": images, "llm": [len(s["input_ids"]) for s in samples]}
    checked = {}
    for k, (name, module, degree, replicas, _) in enumerate(C.CASES):
        shape = shapes[module]
        ns = lengths[module]
        if name == "megatron_tp":
            ns = [max(ns)] * len(ns)  # one microbatch, padded to its longest sequence
        counted = sum(sum(r[k]["by_op"].values()) for r in ranks)  # the group: both ranks
        assert all(tuple(r[k]["case"]) == (name, module, degree, replicas) for r in ranks)
        want = sum(expected_counted(shape, n) for n in ns)
        checked[(name, module)] = counted / want - 1
        assert counted == pytest.approx(want, rel=REL), (name, module, counted, want)
        # and the driver's count for these samples (useful work, no padding) is the model's
        flops = StepFlops({module: ModuleFlops(shape)}, llm="llm")
        unit = shape.unit if isinstance(shape, EncoderShape) else 1
        batch = [_Sample(n // unit, n, module) for n in lengths[module]]
        assert flops.step(batch)[module] == sum(sample_flops(shape, n) for n in lengths[module])
    assert len(checked) == 6, checked
    print("measured / expected - 1:", checked)  # for the report; the assertions above decide


class _Sample:
    """The token counts a :class:`~disagg.data.types.SampleRefs` carries."""

    def __init__(self, rows: int, n: int, module: str) -> None:
        self.num_tokens = n
        self.num_media_tokens = {module: rows} if module != "llm" else {}


@pytest.mark.parametrize(
    "strategy,module,degree,options",
    [
        ("ddp", "vision", 1, {}),
        ("ulysses", "vision", 2, {}),
        ("zero", "vision", 1, {"stage": 3}),
        ("ddp", "llm", 1, {}),
        ("megatron_tp", "llm", 2, {}),
        ("megatron_tp", "llm", 2, {"sequence_parallel": True}),
        ("zero", "llm", 1, {"stage": 2}),
    ],
)
@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_driver_flops_are_the_cost_hooks_count(strategy, module, degree, options, recompute):
    """:func:`disagg.metrics.flops.sample_flops` is each strategy's own ``Cost.flops`` for one
    sample, whole over the ``degree`` ranks that split it (the planner's count, not a second one)."""
    from disagg.bench.published import QWEN2_5_VL_32B
    from disagg.cost import predict
    from disagg.metrics.flops import sample_flops
    from disagg.plan.published import published_shapes
    from disagg.plugins import get_registry

    if strategy not in get_registry().strategies:
        pytest.skip(f"strategy {strategy} not installed")
    shape = published_shapes(QWEN2_5_VL_32B)[module]
    n = 4096 if module == "vision" else 1500
    cost = predict(shape, strategy, degree, 1, n, "bf16", options=options, recompute=recompute)
    assert cost.flops * degree == pytest.approx(sample_flops(shape, n, recompute), rel=1e-12)
