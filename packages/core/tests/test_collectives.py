"""``disagg.kit.collectives`` against one process holding every rank's tensors: forward values
and the gradients autograd sends back, at 2 gloo ranks, with uneven all-to-all splits (a rank
sending nothing to another); and no package source imports a private ``torch`` module (the
functional collectives these replace moved between 2.11 and 2.13)."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
import torch.distributed as dist

from disagg.kit.collectives import all_to_all_rows, gather_rows, scatter_rows
from disagg.testing.dist import run_ranks

ROOT = Path(__file__).resolve().parents[3]
WORLD = 2
#: SPLITS[r][s]: rows rank r sends to rank s
SPLITS = [[2, 3], [0, 1]]


def _x(rank: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, 3, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)


def _w(rank: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, 3, generator=torch.Generator().manual_seed(200 + rank), dtype=torch.float64)


def _on_rank(rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    group, world = dist.group.WORLD, WORLD
    out = {}
    x = _x(rank, 4).requires_grad_()
    y = gather_rows(x, group)
    (y * _w(rank, 4 * world)).sum().backward()
    out["gather"] = (y.detach(), x.grad)

    x = _x(rank, 4).requires_grad_()
    y = scatter_rows(x, group)
    (y * _w(rank, 4 // world)).sum().backward()
    out["scatter"] = (y.detach(), x.grad)

    x = _x(rank, sum(SPLITS[rank])).requires_grad_()
    recv = [SPLITS[s][rank] for s in range(world)]
    y = all_to_all_rows(x, recv, SPLITS[rank], group)
    (y * _w(rank, sum(recv))).sum().backward()
    out["all_to_all"] = (y.detach(), x.grad)
    return out


def _reference() -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Every rank's tensors in one process; the loss is the sum of the ranks' losses."""
    ref: list[dict] = [{} for _ in range(WORLD)]
    xs = [_x(r, 4).requires_grad_() for r in range(WORLD)]
    full = torch.cat(xs)
    sum(
        ((full * _w(r, 4 * WORLD)).sum() for r in range(WORLD)), torch.zeros((), dtype=torch.float64)
    ).backward()
    for r in range(WORLD):
        ref[r]["gather"] = (full.detach(), xs[r].grad)

    xs = [_x(r, 4).requires_grad_() for r in range(WORLD)]
    total = xs[0] + xs[1]
    share = 4 // WORLD
    parts = [total[r * share : (r + 1) * share] for r in range(WORLD)]
    sum(
        ((parts[r] * _w(r, share)).sum() for r in range(WORLD)), torch.zeros((), dtype=torch.float64)
    ).backward()
    for r in range(WORLD):
        ref[r]["scatter"] = (parts[r].detach(), xs[r].grad)

    xs = [_x(r, sum(SPLITS[r])).requires_grad_() for r in range(WORLD)]
    chunks = [torch.split(xs[r], SPLITS[r]) for r in range(WORLD)]
    ys = [torch.cat([chunks[s][r] for s in range(WORLD)]) for r in range(WORLD)]
    sum(
        ((ys[r] * _w(r, ys[r].shape[0])).sum() for r in range(WORLD)), torch.zeros((), dtype=torch.float64)
    ).backward()
    for r in range(WORLD):
        ref[r]["all_to_all"] = (ys[r].detach(), xs[r].grad)
    return ref


def test_values_and_gradients_match_one_process() -> None:
    got, ref = run_ranks(_on_rank, WORLD), _reference()
    for rank in range(WORLD):
        for op in ("gather", "scatter", "all_to_all"):
            (y, g), (y_ref, g_ref) = got[rank][op], ref[rank][op]
            torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12, msg=f"rank {rank} {op} value")
            torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-12, msg=f"rank {rank} {op} gradient")


def _private_torch_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return [
        f"{path.relative_to(ROOT)}:{n}"
        for n in names
        if n.split(".")[0] == "torch" and any(part.startswith("_") for part in n.split(".")[1:])
    ]


def test_no_package_imports_a_private_torch_module() -> None:
    sources = [f for p in sorted((ROOT / "packages").iterdir()) for f in (p / "src").rglob("*.py")]
    assert len(sources) > 50
    assert [hit for f in sources for hit in _private_torch_imports(f)] == []


def test_the_rule_sees_a_private_import(tmp_path: Path) -> None:
    bad = ROOT / "packages" / "core" / ".probe_private.py"
    try:
        bad.write_text("from torch.distributed._functional_collectives import all_to_all_single_autograd\n")
        assert _private_torch_imports(bad) == [
            "packages/core/.probe_private.py:torch.distributed._functional_collectives"
        ]
    finally:
        bad.unlink()
