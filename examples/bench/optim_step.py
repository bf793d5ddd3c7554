"""The optimizer step's host side (gradient all-reduce + global norm + clip +
AdamW) on the tiny Qwen2.5-VL, before and after the bucketed reduction and
the fused norm, on 2 gloo ranks, timed alternately in one run.

- ``before``: what ``Strategy.reduce_gradients`` / ``grad_norm_sq`` / ``step``
  did until now: one all-reduce per gradient tensor, one float64 copy and one
  host sync per tensor for the norm, one clip multiply per tensor;
- ``after``: the same sums through :func:`disagg.kit.all_reduce_bucketed`
  (25 MiB buckets), :func:`disagg.kit.sum_of_squares` (foreach norms,
  one sync) and one foreach multiply.

AdamW is ``foreach=False`` on both (CPU keeps the per-tensor update, bit-equal
to the reference; CUDA takes the fused kernel). The gradients after both are
checked equal before any timing.

    python examples/bench/optim_step.py [--tiny DIR] [--repeat 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist


def modules(tiny: str) -> list[torch.nn.Module]:
    from disagg.plugins import get_registry

    reg = get_registry()
    path = str(Path(tiny) / "qwen2_5_vl")
    return [reg.family(role, "qwen2_5_vl")(path, {}).build(torch.float32) for role in ("encoder", "llm")]


def _grads(params: list[torch.nn.Parameter], rank: int, seed: int) -> None:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def before(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, comm) -> float:
    from disagg.kit import agree_on_grads

    for p, keep in zip(params, agree_on_grads(params, comm)):
        if keep:
            comm.all_reduce(p.grad)
    norm = sum(float(p.grad.detach().double().pow(2).sum()) for p in params if p.grad is not None) ** 0.5
    coef = min(1.0, 1.0 / (norm + 1e-6))
    for p in params:
        p.grad.mul_(coef)
    opt.step()
    return norm


def after(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, comm) -> float:
    from disagg.kit import agree_on_grads, all_reduce_bucketed, sum_of_squares

    present = agree_on_grads(params, comm)
    all_reduce_bucketed([p.grad for p, keep in zip(params, present) if keep], comm)
    norm = float(sum_of_squares([p.grad for p in params])) ** 0.5
    coef = min(1.0, 1.0 / (norm + 1e-6))
    torch._foreach_mul_([p.grad for p in params], coef)
    opt.step()
    return norm


def rank_main(rank: int, tiny: str, repeat: int) -> dict:
    from disagg.interfaces import CommCounter

    torch.set_num_threads(1)
    params = [p for m in modules(tiny) for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=False)
    comm = CommCounter()
    # the same reduction: equal gradients and norms before anything is timed
    _grads(params, rank, 0)
    before_norm = before(params, torch.optim.SGD(params, lr=0.0), comm)
    want = [p.grad.clone() for p in params]
    _grads(params, rank, 0)
    after_norm = after(params, torch.optim.SGD(params, lr=0.0), comm)
    assert all(torch.equal(a, p.grad) for a, p in zip(want, params)), "bucketed reduction differs"
    assert abs(before_norm - after_norm) <= 1e-12 * before_norm, (before_norm, after_norm)
    times: dict[str, list[float]] = {"before": [], "after": []}
    calls: dict[str, dict[str, int]] = {}
    for i in range(repeat):
        for name, fn in (("before", before), ("after", after)):
            _grads(params, rank, i + 1)
            comm.reset()
            dist.barrier()
            t0 = time.perf_counter()
            fn(params, opt, comm)
            times[name].append(time.perf_counter() - t0)
            calls[name] = comm.calls()
    return {
        "tensors": len(params),
        "parameters": sum(p.numel() for p in params),
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "calls": calls,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", default=None, help="a `disagg make-tiny` dir (default: made in a temp dir)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from disagg.testing.dist import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        tiny = args.tiny
        if tiny is None:
            from disagg.cli.make_tiny import make_tiny

            tiny = str(Path(tmp) / "tiny")
            make_tiny(Path(tiny), ["qwen2_5_vl"], train_per_class=1, eval_per_class=1, image_size=56)
        ranks = run_ranks(rank_main, 2, tiny, args.repeat)
    slowest = {k: max(r["median_s"][k] for r in ranks) for k in ("before", "after")}
    res = {
        **ranks[0],
        "median_s_slowest_rank": slowest,
        "ratio_before_over_after": slowest["before"] / slowest["after"],
    }
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
