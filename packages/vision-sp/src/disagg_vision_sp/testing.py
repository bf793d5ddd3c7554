"""Equivalence harness: ``ulysses`` ranks vs the single-process HF encoder.

Used by this package's tests and usable by end-to-end tests: the reference and
the ranks see the same samples and the same upstream gradient (a fixed random
tensor over each sample's full output), so outputs and parameter gradients
must agree to fp32 rounding.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from disagg.interfaces import EncoderFamily, GroupContext, OptimSpec, StrategyOptions
from disagg.testing.tolerance import assert_tensor_close, assert_tensors_close


def random_images(sizes: list[tuple[int, int]], seed: int = 0) -> list[Any]:
    """Deterministic RGB PIL images of the given (width, height)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    out = []
    for w, h in sizes:
        arr = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)
        out.append(Image.fromarray(arr.numpy(), "RGB"))
    return out


def upstream_grads(
    family: EncoderFamily, inputs: list[dict[str, torch.Tensor]], seed: int = 1
) -> list[torch.Tensor]:
    """The fixed 'gradient from the LLM' of each sample's full embedding."""
    g = torch.Generator().manual_seed(seed)
    hidden = family.hidden_size()
    return [torch.randn(sum(family.num_tokens(x)), hidden, generator=g) for x in inputs]


def reference(
    family: EncoderFamily, inputs: list[dict[str, torch.Tensor]], grads: list[torch.Tensor]
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Unpartitioned HF forward of every sample, backward from ``grads``.

    Parameters that get no gradient (LLaVA's unused last tower layer and
    post-layernorm) are absent from the returned gradients, not zero: a
    strategy must leave them ``None`` too, or AdamW would move them."""
    module = family.build(torch.float32)
    outs = [family.encode(module, x) for x in inputs]
    torch.autograd.backward(outs, grads)
    pgrads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    return [o.detach() for o in outs], pgrads


def ulysses_rank(
    rank: int,
    degree: int,
    replicas: int,
    family_cls: type,
    path: str,
    options: dict[str, Any],
    inputs: list[dict[str, torch.Tensor]],
    grads: list[torch.Tensor],
) -> dict[str, Any]:
    """One rank (under ``disagg.testing.dist.run_ranks``): replica ``r`` encodes
    samples ``r::replicas``, backwards their gradient rows, reduces gradients.

    Returns (serialized) the shards it produced, the reduced parameter
    gradients (rank 0 only) and its all-to-all byte count.
    """
    from disagg_vision_sp.ulysses.strategy import UlyssesStrategy

    ctx = GroupContext(
        module="vision",
        rank=rank,
        world_size=degree * replicas,
        degree=degree,
        replicas=replicas,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    family = family_cls(Path(path), options)
    strategy = UlyssesStrategy(ctx, family, StrategyOptions())
    strategy.setup(family.build(torch.float32), OptimSpec(lr=1e-3))
    mine = list(range(ctx.replica, len(inputs), replicas))
    shards = strategy.encode(0, [inputs[i] for i in mine])
    strategy.backward(0, [s.value for s in shards], [grads[i][s.positions] for i, s in zip(mine, shards)])
    a2a = int(ctx.comm.bytes_by_op.get("all_to_all", 0))
    strategy.reduce_gradients()
    out: dict[str, Any] = {
        "samples": mine,
        "shards": [(s.positions, s.value.detach(), s.total) for s in shards],
        "all_to_all_bytes": a2a,
        "grad_norm_sq": strategy.grad_norm_sq(),
    }
    if rank == 0:
        out["grads"] = {n: g.clone() for n, g in strategy.full_grads().items()}
    # Plain bytes: tensors sent through a torch.multiprocessing queue are shared by file
    # descriptor and die with the rank process before the parent reads them.
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def run_ulysses(
    degree: int,
    replicas: int,
    family: EncoderFamily,
    inputs: list[dict[str, torch.Tensor]],
    grads: list[torch.Tensor],
) -> list[dict[str, Any]]:
    """Run :func:`ulysses_rank` on ``degree * replicas`` gloo ranks; results by rank."""
    from disagg.testing.dist import run_ranks

    raw = run_ranks(
        ulysses_rank,
        degree * replicas,
        degree,
        replicas,
        type(family),
        str(family.path),
        family.options,
        inputs,
        grads,
    )
    return [torch.load(io.BytesIO(r), weights_only=False) for r in raw]


def assemble(results: list[dict[str, Any]], n_samples: int, hidden: int) -> list[torch.Tensor]:
    """Each sample's full embedding from the shards of every rank (what the LLM does)."""
    full: list[torch.Tensor | None] = [None] * n_samples
    seen: list[torch.Tensor | None] = [None] * n_samples
    for res in results:
        for i, (pos, val, total) in zip(res["samples"], res["shards"]):
            if full[i] is None:
                full[i] = torch.full((total, hidden), float("nan"))
                seen[i] = torch.zeros(total, dtype=torch.long)
            full[i][pos] = val
            seen[i][pos] += 1
    for i, s in enumerate(seen):
        if s is None or not bool((s == 1).all()):
            raise AssertionError(f"sample {i}: rows not covered exactly once by the shards")
    return [f for f in full]  # type: ignore[misc]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """fp32 equivalence of one tensor, by the project's policy (``disagg.testing.tolerance``): per
    element against the tensor's own scale."""
    assert_tensor_close(actual, expected, what)


def assert_grads_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """The same parameters have a gradient (a reference ``None`` must stay ``None``, never become
    zeros), and each is equal per element against its own scale (``disagg.testing.tolerance``).
    No floor borrowed from other tensors: a small tensor (a norm weight's gradient) is held to its
    own size."""
    assert_tensors_close(actual, expected, "grad ")
