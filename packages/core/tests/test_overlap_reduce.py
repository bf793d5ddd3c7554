"""The overlapped gradient all-reduce sums exactly what the after-backward bucketed all-reduce sums,
with an all-to-all running in the same backward, a parameter only one rank touches, one no rank
touches, a rank whose last microbatch has no rows of its own, and several buckets."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from disagg.interfaces.comm import CommCounter
from disagg.kit.collectives import all_to_all_rows
from disagg.kit.grads import agree_on_grads, all_reduce_bucketed
from disagg.kit.grads.overlap import OverlappedReducer
from disagg.testing.dist import run_ranks
from disagg.testing.tolerance import assert_exact

CAP = 3 * 16 * 4  # bytes: several small buckets over the model below


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.only_rank0 = nn.Linear(16, 16)
        self.unused = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, rank: int, world: int, rows: list[int]) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x)))
        # rows exchanged between ranks (ulysses-like): its backward is an all-to-all on the default
        # group; a rank with no rows of its own still receives its share of the others'
        send = [rows[rank] // world] * world
        recv = [n // world for n in rows]
        h = all_to_all_rows(h, recv, send, dist.group.WORLD)
        if rank == 0:
            h = h + self.only_rank0(h)
        return self.c(h).square().sum()


def _step(rank: int, world: int, overlap: bool) -> tuple[dict[str, torch.Tensor | None], int, int]:
    net = Net()
    comm = CommCounter()
    reducer = OverlappedReducer(list(net.parameters()), comm, cap_bytes=CAP) if overlap else None
    g = torch.Generator().manual_seed(10 + rank)
    # two microbatches; in the last one rank 1 has no rows of its own (a and b get no input there)
    for mb in range(2):
        rows = [4 * world if r == 0 or mb == 0 else 0 for r in range(world)]
        if reducer is not None and mb == 1:
            reducer.arm()
        x = torch.randn(rows[rank], 8, generator=g)
        net(x, rank, world, rows).backward()
    params = list(net.parameters())
    early, buckets = 0, 0
    if reducer is not None:
        reducer.finish()
        early, buckets = comm.overlapped_calls, len(reducer.buckets)
    else:
        present = agree_on_grads(params, comm)
        all_reduce_bucketed([p.grad for p, keep in zip(params, present) if keep], comm, cap_bytes=CAP)
    grads = {k: (None if p.grad is None else p.grad.clone()) for k, p in net.named_parameters()}
    return grads, early, buckets


def _double(rank: int, world: int) -> str:
    net = Net()
    reducer = OverlappedReducer(list(net.parameters()), CommCounter(), cap_bytes=CAP)
    reducer.arm()
    loss = net(torch.randn(4 * world, 8), rank, world, [4 * world] * world)
    loss.backward(retain_graph=True)
    try:
        loss.backward()
    except RuntimeError as e:
        return str(e)
    finally:
        reducer.finish()
    return ""


def _all(rank: int, world: int) -> tuple:
    want, _, _ = _step(rank, world, overlap=False)
    got, early, buckets = _step(rank, world, overlap=True)
    return want, got, early, buckets, _double(rank, world)


def test_overlapped_sums_equal_bucketed_sums() -> None:
    world = 2
    results = run_ranks(_all, world, world)  # one spawn for every check: a spawn costs more than they do
    (want0, got0, early0, buckets, _), (_, got1, early1, _, _) = results
    # rank 0 sent buckets while its backward ran; rank 1, whose last backward never reaches
    # only_rank0, sent that bucket and the ones after it in finish, in the same order
    assert buckets > 2 and 0 < early0 and early1 < buckets
    for rank, (want, got, *_rest, msg) in enumerate(results):
        assert "second gradient in the step's last backward" in msg
        assert want.keys() == got.keys()
        assert want["unused.weight"] is None and got["unused.weight"] is None  # no rank: AdamW skips it
        assert got["only_rank0.weight"] is not None  # one rank's gradient reaches every rank
        for k, w in want.items():
            if w is not None:
                assert_exact(got[k], w, f"rank {rank} {k}")
    for k, v in got0.items():  # every rank ends with the same sums
        if v is not None:
            assert_exact(got1[k], v, f"rank 1 vs rank 0 {k}")
