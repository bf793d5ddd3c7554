"""``route`` is a pure function: property checks over random microbatches and
group shapes, without Ray."""

from __future__ import annotations

import random

import pytest

from disagg.runtime.routing import GroupShape, SampleInfo, contiguous, route


def _random_case(rng: random.Random):
    n = rng.randint(0, 9)
    samples = []
    for i in range(n):
        media = {}
        for m in ("vision", "audio"):
            k = rng.choice([0, 0, 1, 2])  # 0, 1 or several media of each modality
            if k:
                media[m] = k * rng.randint(1, 64)
        samples.append(SampleInfo(index=100 + i, media_tokens=media, tokens=rng.randint(5, 90)))
    encoders = [GroupShape(m, rng.randint(1, 4), rng.randint(1, 3)) for m in ("vision", "audio")]
    degree = rng.randint(1, 4)
    llm = GroupShape("llm", degree, rng.randint(1, 3), grad_shard=rng.randrange(degree))
    return samples, encoders, llm


@pytest.mark.parametrize("seed", range(300))
def test_route_properties(seed):
    rng = random.Random(seed)
    samples, encoders, llm = _random_case(rng)
    r = route(samples, encoders, llm)
    ids = [s.index for s in samples]

    # the LLM replicas partition the microbatch; every replica has a task
    assert [t.replica for t in r.llm] == list(range(llm.replicas))
    assert sorted(i for t in r.llm for i in t.samples) == sorted(ids)
    for t in r.llm:
        assert t.ranks == tuple(range(t.replica * llm.degree, (t.replica + 1) * llm.degree))
        assert t.grad_rank == t.ranks[llm.grad_shard]

    for g in encoders:
        with_media = [s.index for s in samples if g.module in s.media_tokens]
        tasks = [t for t in r.encodes if t.module == g.module]
        if not with_media:
            assert tasks == [] and r.encoded_ranks(g.module) == []  # the whole group skips alike
            continue
        # every replica runs (possibly empty); together they encode each sample with media once
        assert [t.replica for t in tasks] == list(range(g.replicas))
        assert sorted(i for t in tasks for i in t.samples) == sorted(with_media)
        assert r.encoded_ranks(g.module) == list(range(g.degree * g.replicas))

    # ids are explicit and dense; each source ships samples its encoder rank
    # encoded to the LLM replica that owns them, once per (rank, replica)
    assert [s.id for s in r.sources] == list(range(len(r.sources)))
    owner = {i: t.replica for t in r.llm for i in t.samples}
    seen = set()
    for s in r.sources:
        task = next(t for t in r.encodes if t.module == s.module and s.rank in t.ranks)
        assert set(s.samples) <= set(task.samples) and s.samples
        assert all(owner[i] == s.llm_replica for i in s.samples)
        assert (s.module, s.rank, s.llm_replica) not in seen
        seen.add((s.module, s.rank, s.llm_replica))
        assert s.id in r.llm[s.llm_replica].sources
    # every (sample, module, encoder rank) pair reaches the sample's LLM replica exactly once
    for g in encoders:
        for t in (t for t in r.encodes if t.module == g.module):
            for rank in t.ranks:
                shipped = sorted(i for s in r.sources_of(g.module, rank) for i in s.samples)
                assert shipped == sorted(t.samples)


def test_route_uses_the_given_assignment():
    samples = [SampleInfo(i, {"vision": c}, tokens=c) for i, c in enumerate([100, 1, 1, 100])]
    enc = [GroupShape("vision", 1, 2)]
    llm = GroupShape("llm", 1, 2)

    def interleave(costs, parts):
        return [list(range(p, len(costs), parts)) for p in range(parts)]

    assert [t.samples for t in route(samples, enc, llm).encodes] == [(0, 1), (2, 3)]
    assert [t.samples for t in route(samples, enc, llm, interleave).encodes] == [(0, 2), (1, 3)]
    assert contiguous([5, 5, 5], 2) == [[0, 1], [2]]


def test_repeated_sample_ids_are_refused():
    s = SampleInfo(1, {}, 3)
    with pytest.raises(ValueError, match="repeat"):
        route([s, s], [], GroupShape("llm", 1, 1))
