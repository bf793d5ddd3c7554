"""What the cost model predicts for the first-party strategies, as one JSON-able dict.

``python packages/core/tests/cost_fixture.py`` wrote ``data/cost_predictions.json.gz``
before the cost formulas moved from core into the plugins (issue 24);
``test_cost_change_detector.py`` recomputes the same dict with the code at hand and asserts
it equals the file exactly (re-recorded when a decoder's logits term became one loss chunk,
``parallel.llm.loss_chunk_tokens``, and when ``ddp``/``ulysses`` got ``parallel.<m>.shard``:
its variants estimated and searched by the plans; when ``CostQuery.dtype`` became the
precision recipe, ``CostQuery.precision``: the published grid under ``bf16``, 18 bytes per
trained element with its fp32 master, where the compute dtype ``bfloat16`` had meant fp32
state at 16; when ``zero`` honoured the recipes in DeepSpeed's bf16 mode: its published
estimates under ``bf16``, 18 bytes per element at stage 3, 2-byte gathers and the weights'
2 bytes in stages 1-2, where they had counted DeepSpeed's fp32 mode): every strategy's
``estimate`` on a grid of queries
(published Qwen2.5-VL-32B and the tiny Qwen2.5-VL), ``disagg bench --predict``'s rows
and ``disagg plan``'s full ranking on both, on clusters without the efficiency curve
(every FLOP at the MFU, the time model before issue 24 item 2).

``by_shape`` (added with item 2, compute time by GEMM shape): the same on the ``h100x8``
preset's curve: each estimate's compute seconds, ``bench --predict``'s rows and the
published plan at 16k vision tokens, and the tiny model's plan on 2 such GPUs (beside its
flat plan, which ``test_cost_time_only_moves`` compares it with: only time moves).

Re-recorded when the memory model began counting the allocator's view on GPU presets (CUDA
contexts, NCCL buffers, the step's transient, fragmentation: :mod:`disagg.kit.cost.memory`) and
the GPU presets' usable fraction became 0.9: every GPU plan's memory and fit moved, and the
predicted rows' ``memory_per_gpu``. The published plans are recorded without the planner's
modelled ``context_parallel`` / ``offload`` layouts (``modelled_keys=False``: tens of thousands more
rows); those are printed by ``python -m disagg.bench.published``.

Re-recorded when ``zero`` began counting DeepSpeed ZeRO-3's gradient reduce bucket
(``Cost.buffer_bytes``, issue 38: ``reduce_bucket_size`` x the reduction dtype, 2 GB per rank at
DeepSpeed's default in fp32/bf16): the 432 stage-3 estimates gained ``buffer_bytes`` and their
``memory_bytes`` moved, and with them the memory of every layout with a ``zero`` stage-3 group
(and so the order of the ranked rows); no other estimate or layout moved, no layout's fit flipped
and every plan's best layout is the same (checked by diffing the old and new file).

Re-recorded when ``ddp`` began estimating ``shard: gradients|parameters`` on the LLM (FSDP2 with
the lockstep placeholder, issue 37; ``None`` before): those LLM estimates were added (with the
whole units FSDP2 holds gathered beside its shards), and the published plans rank layouts with
the LLM under ``ddp`` + FSDP2 (at 16k one leads: ``test_plan_published.py``).

Re-recorded when ``ddp`` began counting its flat gradient all-reduce bucket (``Cost.buffer_bytes``,
issue 38: the largest bucket of several gradients, at most 25 MiB, :mod:`disagg.kit.grads`; on
more than one rank, not under FSDP2 or ``offload: optimizer``; ``tests/test_allocator_peak.py``
had added it itself): the 360 ``ddp`` estimates on more than one rank with ``shard: none |
optimizer`` gained ``buffer_bytes`` (25.7 MB for the published tower) and their ``memory_bytes``
moved, and with them the memory of the layouts with such a group; no other estimate moved,
``bench --predict``'s rows did not, no layout's fit flipped and every plan's best layout is the
same (checked by diffing the old and new file).

Re-recorded when ``ulysses`` began counting its gradient reduction's flat bucket as ``ddp`` does
(``Cost.buffer_bytes``, :func:`disagg.kit.cost.grad_buckets.grad_bucket_bytes`, issue 38's
cost-model leftovers; ``mlp_tiles`` added nothing here, it is off by default): the ulysses
estimates gained ``buffer_bytes`` and their ``memory_bytes`` moved, and with them the memory of
the layouts holding a ``ulysses`` group (and the order of equal-time rows); no other estimate
moved, no layout's fit flipped and every plan's best layout is the same (checked by diffing the
old and new file).

Re-recorded when ``megatron_tp`` with sequence parallelism began keeping the column linears' inputs
as shards in a recomputed block's replay (re-gathered in its backward, as Megatron does): under
``recompute: full`` each replay counts two all-gathers per block more (``disagg_llm_tp.cost.replay``)
and ``mlp_tiles`` one fewer per block (``tile_comm``); only those estimates' collectives and the
times built on them moved (``bench --predict``'s DHP-SP / TP ratio at 16k: 1.40 -> 1.34 on the
``h100x8`` curve, 1.17 -> 1.14 flat); memory did not move (the model counted shards already).
"""

from __future__ import annotations

import functools
import gzip
import itertools
import json
import sys
from pathlib import Path
from typing import Any

FIXTURE = Path(__file__).parent / "data" / "cost_predictions.json.gz"
FIRST_PARTY = ("ddp", "megatron_tp", "ulysses", "zero")
#: option variants asked per strategy (besides recompute), as the planner searched them before
VARIANTS: dict[str, list[dict[str, Any]]] = {
    "ddp": [{}, {"shard": "optimizer"}, {"shard": "gradients"}, {"shard": "parameters"}],
    "ulysses": [{}, {"shard": "optimizer"}, {"shard": "gradients"}, {"shard": "parameters"}],
    "megatron_tp": [{}, {"sequence_parallel": True}],
    "zero": [{"stage": 1}, {"stage": 2}, {"stage": 3}, {"stage": 3, "offload_optimizer": True}],
}


def tiny_config() -> dict[str, Any]:
    """The tiny Qwen2.5-VL's ``config.json`` (``disagg make-tiny``'s qwen2_5_vl), built once."""
    import tempfile

    from disagg_vision_sp.families.tiny_qwen2_5_vl import make_tiny_qwen2_5_vl

    with tempfile.TemporaryDirectory() as tmp:
        return json.loads((make_tiny_qwen2_5_vl(Path(tmp) / "m") / "config.json").read_text())


def _strategies() -> dict[str, Any]:
    from disagg.plugins import get_registry

    reg = get_registry().strategies
    return {n: reg[n] for n in FIRST_PARTY if n in reg}


def _shapes(cfg: dict[str, Any]) -> dict[str, Any]:
    try:
        from disagg.plan.published import published_shapes
    except ImportError:  # before issue 24: core read Qwen2.5-VL shapes itself
        from disagg.cost import shapes_from_hf_config as published_shapes
    return published_shapes(cfg)


def estimates(
    name: str,
    cfg: dict[str, Any],
    vision_tokens: int,
    text_tokens: int,
    precision: str,
    keep: list[Any] | None = None,
) -> list[dict[str, Any]]:
    """The grid's rows; ``keep`` collects each row's ``Cost`` (None where there is none)."""
    kept = [] if keep is None else keep
    from disagg.interfaces import CostQuery

    shapes = _shapes(cfg)
    vision, llm = shapes["vision"], shapes["llm"]
    rows = vision_tokens // vision.unit
    out = []
    for sname, cls in _strategies().items():
        for module, shape in (("vision", vision), ("llm", llm)):
            seq = vision_tokens if module == "vision" else rows + text_tokens
            grid = itertools.product(
                (1, 2, 8), (1, 2), ((1, 1), (2, 1), (2, 2)), ("none", "full", "selective")
            )
            for degree, replicas, (micro, inflight), rc in grid:
                for variant in VARIANTS[sname]:
                    opts = dict(variant)
                    if rc != "none":
                        opts["recompute"] = rc
                    try:
                        options = cls.options_model(**opts)
                    except Exception as exc:  # the strategy does not offer this recompute mode
                        kept.append(None)
                        out.append(
                            {
                                "key": [name, sname, module, degree, replicas, micro, inflight, rc, variant],
                                "error": type(exc).__name__,
                            }
                        )
                        continue
                    q = CostQuery(
                        shape=shape,
                        degree=degree,
                        replicas=replicas,
                        seq_len=seq,
                        precision=precision,
                        samples=2 * replicas * micro,
                        microbatches=micro,
                        inflight=inflight,
                        exchanged_rows=None if module == "vision" else rows,
                        exchanged_width=None if module == "vision" else vision.out_hidden,
                        recompute=rc,
                    )
                    cost = cls.estimate(q, options)
                    kept.append(cost)
                    out.append(
                        {
                            "key": [name, sname, module, degree, replicas, micro, inflight, rc, variant],
                            "cost": None if cost is None else cost.to_dict(),
                        }
                    )
    return out


def ranking(result: Any) -> list[list[Any]]:
    return [[x.name(), x.step_time_s, x.memory_bytes, x.fits] for x in result.ranked + result.oom]


#: the h100x8 preset's MFU before its efficiency curve (the flat model's)
FLAT_MFU = 0.4


def _flat(cluster: Any) -> Any:
    from disagg.plan.efficiency import flat

    return flat(cluster, FLAT_MFU if cluster.name.startswith("h1") else None)


class Only:
    """The registry with the first-party strategies only (a third party's would join the ranking)."""

    @property
    def strategies(self) -> dict[str, Any]:
        return _strategies()

    @property
    def families(self) -> Any:
        from disagg.plugins import get_registry

        return get_registry().families


def plans(tiny: dict[str, Any]) -> dict[str, Any]:
    from disagg.plan.cluster import cluster_from
    from disagg.plan.model import Workload
    from disagg.plan.published import plan_published, summary
    from disagg.plan.search import plan

    out: dict[str, Any] = {}
    for n in (16384, 65536):
        r = plan_published(n, Only(), _flat(cluster_from("h100x8")), modelled_keys=False)  # type: ignore[arg-type]
        out[f"published-{n}"] = {"summary": summary(r), "ranking": ranking(r)}
    work = Workload(shapes=_shapes(tiny), vision_tokens=256, text_tokens=32, samples=2)
    r = plan(work, _flat(cluster_from("cpu", {"gpus": 2})), _strategies())
    out["tiny-cpu2"] = {"ranking": ranking(r)}
    return out


def by_shape(tiny: dict[str, Any], estimated: list[Any]) -> dict[str, Any]:
    """Predictions on the ``h100x8`` preset's efficiency curve (module docstring)."""
    from disagg.bench.published import LAYOUTS_32B, predict_published, ratios
    from disagg.plan.cluster import PRESETS, cluster_from
    from disagg.plan.efficiency import compute_seconds
    from disagg.plan.model import Workload
    from disagg.plan.published import plan_published, summary
    from disagg.plan.search import plan

    gpu = PRESETS["h100x8"]
    rows = [r for r in predict_published([4096, 16384, 65536]) if r["layout"] in LAYOUTS_32B]
    published = plan_published(16384, Only(), modelled_keys=False)  # type: ignore[arg-type]
    work = Workload(shapes=_shapes(tiny), vision_tokens=256, text_tokens=32, samples=2)
    two = cluster_from("h100x8", {"gpus": 2})
    tiny_plans = {name: plan(work, c, _strategies()) for name, c in (("shaped", two), ("flat", _flat(two)))}
    return {
        "compute_s": [None if c is None else compute_seconds(c, gpu) for c in estimated],
        "bench_predict": {"rows": rows, "ratios": ratios(rows), "ratios_none": ratios(rows, "none")},
        "plans": {
            "published-16384": {"summary": summary(published), "ranking": ranking(published)},
            "tiny-h100x2": {k: {"ranking": ranking(r), "layouts": layouts(r)} for k, r in tiny_plans.items()},
        },
    }


def layouts(result: Any) -> dict[str, Any]:
    """Each planned layout's machine-independent figures, by name (what only-time-moves compares)."""
    return {
        x.name(): {"memory_bytes": x.memory_bytes, "costs": {m: c.to_dict() for m, c in x.costs.items()}}
        for x in result.ranked + result.oom
    }


def dump(tiny: dict[str, Any]) -> dict[str, Any]:
    """Everything predicted, for the published setting and the ``tiny`` config."""
    from disagg.bench.published import LAYOUTS_32B, QWEN2_5_VL_32B, predict_published, ratios

    # since issue 24 every installed strategy is predicted (uniform_<name>): the paper's layouts are recorded
    rows = [r for r in predict_published([4096, 16384, 65536], flat=True) if r["layout"] in LAYOUTS_32B]
    kept: list[Any] = []
    return {
        "tiny_config": tiny,
        "estimates": (
            estimates("published", QWEN2_5_VL_32B, 16384, 512, "bf16", kept)
            + estimates("tiny", tiny, 256, 32, "fp32", kept)
        ),
        "bench_predict": {"rows": rows, "ratios": ratios(rows), "ratios_none": ratios(rows, "none")},
        "plans": plans(tiny),
        "by_shape": by_shape(tiny, kept),
    }


@functools.cache
def recorded_and_current() -> tuple[dict[str, Any], dict[str, Any]]:
    """The recorded file and :func:`dump` of the code at hand on its tiny config, computed once per
    session (the change detector and the only-time-moves invariant both read it)."""
    recorded = json.loads(gzip.decompress(FIXTURE.read_bytes()))
    return recorded, json.loads(json.dumps(dump(recorded["tiny_config"]), sort_keys=True))


if __name__ == "__main__":
    # mtime=0: the same predictions give the same bytes
    FIXTURE.write_bytes(gzip.compress(json.dumps(dump(tiny_config()), sort_keys=True).encode(), mtime=0))
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)", file=sys.stderr)
