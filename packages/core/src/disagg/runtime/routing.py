"""Routing as data: which rank of which group handles which sample.

:func:`route` is a pure function of one microbatch and the groups' shapes,
with explicit ids for every shard source (one encoder rank's shards for one
LLM replica) and for where each source's gradients go back. The driver wires
ObjectRefs from a :class:`Route` and never re-derives an id from a position;
training and evaluation are built from the same route. Routing is per
sample, so groups may differ in degree and replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: ``assign(costs, parts)`` -> sample positions per part: disjoint, covering,
#: deterministic (contiguous slices by default; a balancing one from the data pipeline)
Assign = Callable[[Sequence[int], int], list[list[int]]]


@dataclass(frozen=True)
class GroupShape:
    """What routing needs of a group."""

    module: str
    degree: int
    replicas: int
    #: LLM only: the rank inside a replica whose embedding gradients go back
    #: (``Strategy.returns_input_grads``)
    grad_shard: int = 0

    def ranks(self, replica: int) -> tuple[int, ...]:
        return tuple(range(replica * self.degree, (replica + 1) * self.degree))


@dataclass(frozen=True)
class SampleInfo:
    """The driver-side facts about one sample (no tensors)."""

    index: int
    #: encoder module -> placeholder tokens (the sample has media for exactly these modules)
    media_tokens: dict[str, int]
    tokens: int = 0


@dataclass(frozen=True)
class EncodeTask:
    """One replica of an encoder group encodes these samples (possibly none:
    every replica of a group with work runs, so collectives stay matched)."""

    module: str
    replica: int
    ranks: tuple[int, ...]
    samples: tuple[int, ...]


@dataclass(frozen=True)
class Source:
    """The shards one encoder rank produced for one LLM replica."""

    id: int
    module: str
    rank: int
    llm_replica: int
    samples: tuple[int, ...]


@dataclass(frozen=True)
class LLMTask:
    replica: int
    ranks: tuple[int, ...]
    samples: tuple[int, ...]
    #: ids of the sources this replica assembles its embeddings from
    sources: tuple[int, ...]
    #: the LLM rank that sends these sources' gradients back
    grad_rank: int


@dataclass(frozen=True)
class Route:
    encodes: tuple[EncodeTask, ...]
    sources: tuple[Source, ...]
    llm: tuple[LLMTask, ...]

    def source(self, sid: int) -> Source:
        return self.sources[sid]

    def sources_of(self, module: str, rank: int) -> list[Source]:
        """The sources whose gradients ``rank`` of ``module`` must receive."""
        return [s for s in self.sources if s.module == module and s.rank == rank]

    def encoded_ranks(self, module: str) -> list[int]:
        return [r for t in self.encodes if t.module == module for r in t.ranks]


def route(
    samples: Sequence[SampleInfo],
    encoders: Sequence[GroupShape],
    llm: GroupShape,
    assign: Assign | None = None,
) -> Route:
    """Route one microbatch: encoder replicas get the samples with their media
    (balanced by ``assign`` on placeholder tokens), LLM replicas get all samples
    (balanced on tokens), and every (encoder rank, LLM replica) pair that
    shares samples becomes a :class:`Source`."""
    assign = assign or contiguous
    ids = [s.index for s in samples]
    if len(set(ids)) != len(ids):
        raise ValueError(f"sample ids repeat in one microbatch: {ids}")
    llm_parts = assign([s.tokens for s in samples], llm.replicas)
    owner = {ids[p]: r for r, part in enumerate(llm_parts) for p in part}
    encodes: list[EncodeTask] = []
    sources: list[Source] = []
    for g in encoders:
        with_media = [s for s in samples if g.module in s.media_tokens]
        if not with_media:
            continue  # every rank of the group skips alike: no collective is left waiting
        parts = assign([s.media_tokens[g.module] for s in with_media], g.replicas)
        for r, part in enumerate(parts):
            sids = tuple(with_media[p].index for p in part)
            encodes.append(EncodeTask(g.module, r, g.ranks(r), sids))
            for llm_r in range(llm.replicas):
                wanted = tuple(i for i in sids if owner[i] == llm_r)
                if wanted:
                    for rank in g.ranks(r):
                        sources.append(Source(len(sources), g.module, rank, llm_r, wanted))
    tasks = tuple(
        LLMTask(
            replica=r,
            ranks=llm.ranks(r),
            samples=tuple(ids[p] for p in part),
            sources=tuple(s.id for s in sources if s.llm_replica == r),
            grad_rank=r * llm.degree + llm.grad_shard,
        )
        for r, part in enumerate(llm_parts)
    )
    return Route(tuple(encodes), tuple(sources), tasks)


def split_microbatches(n: int, microbatches: int) -> list[range]:
    """Positions of a global batch of ``n`` samples in each microbatch."""
    return balanced(n, microbatches)


def contiguous(costs: Sequence[int], parts: int) -> list[list[int]]:
    """Contiguous, disjoint, covering slices whose sizes differ by at most one."""
    return [list(r) for r in balanced(len(costs), parts)]


def balanced(n: int, parts: int) -> list[range]:
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out
