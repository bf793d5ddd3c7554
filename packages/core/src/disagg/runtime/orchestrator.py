"""The driver's step: each microbatch is routed (:mod:`disagg.runtime.routing`),
its phases are submitted in the order the schedule gives
(:mod:`disagg.interfaces.schedule`), gradients go back to the exact encoder
rank that produced each shard, one global clip, and every group steps. The
driver holds ObjectRefs and small numbers only. How a failed or stalled rank is
reported lives in :mod:`disagg.runtime.failures`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from disagg.builtin.schedules import Sequential
from disagg.data.types import SampleRefs
from disagg.interfaces.schedule import Schedule, check_order
from disagg.kit.strategy import clip_coefficient
from disagg.metrics.record import StepResult, reduce_group
from disagg.runtime.failures import ActorDied, GroupFailure, actor_failure, name_actors, wait_all
from disagg.runtime.feature_cache import FeatureCache
from disagg.runtime.groups import Group, GroupSpec, start_groups, stop_groups
from disagg.runtime.routing import Assign, GroupShape, Route, SampleInfo, route, split_microbatches


@dataclass
class _Flight:
    """One microbatch between its forward and its backward."""

    mb: int
    samples: list[SampleRefs]
    route: Route
    #: (source id, context-parallel rank of its LLM replica) -> ref
    shard_refs: dict[tuple[int, int], Any] = field(default_factory=dict)
    #: feature cache hits: sample index -> module -> the entry's parts (one per encoder rank)
    cached: dict[int, dict[str, list[Any]]] = field(default_factory=dict)
    #: feature cache misses to keep: (sample index, module) -> key
    keys: dict[tuple[int, str], str] = field(default_factory=dict)


class Orchestrator:
    """Drives the groups of one run through training steps."""

    def __init__(
        self,
        specs: list[GroupSpec],
        *,
        placement: str = "collocated",
        device: str = "cpu",
        precision: str = "fp32",
        seed: int = 0,
        microbatches: int = 1,
        clip_grad_norm: float | None = None,
        transport: Any = None,
        collective_timeout_s: float = 600.0,
        start_timeout_s: float = 900.0,
        placement_timeout_s: float | None = None,
        schedule: Schedule | None = None,
        max_inflight: int = 2,
        assign: Assign | None = None,
        caches: dict[str, FeatureCache] | None = None,
    ) -> None:
        if not specs or specs[-1].family.role != "llm":
            raise ValueError("the last group must be the language model")
        self.specs = specs
        self.microbatches = microbatches
        self.clip_grad_norm = clip_grad_norm
        self.schedule = schedule or Sequential()
        self.max_inflight = max_inflight
        self.assign = assign
        #: frozen encoders' feature caches, by module (``parallel.<m>.feature_cache``)
        self.caches = dict(caches or {})
        # no rank makes progress for this long: something waits that never comes
        self.stall_s = collective_timeout_s + 60.0
        self.groups: list[Group] = start_groups(
            specs,
            placement=placement,
            device=device,
            precision=precision,
            seed=seed,
            collective_timeout_s=collective_timeout_s,
            start_timeout_s=start_timeout_s,
            placement_timeout_s=placement_timeout_s,
        )
        self.transport = transport
        if transport is not None:
            transport.setup([a for g in self.groups for a in g.actors])
        self._opts = transport.call_options() if transport is not None else {}
        # shards and gradients leave their device only for the object store
        self._host = not (transport is not None and transport.on_device)
        self._mb_counter = 0
        self._side_refs: list[Any] = []
        self.steps_done = 0
        name_actors(
            {
                actor_id: f"module {g.module!r} rank {r}"
                for g in self.groups
                for r, actor_id in enumerate(g.actor_ids)
            }
        )
        self._shapes = [GroupShape(g.module, g.spec.replica_size, g.spec.replicas) for g in self.encoders]
        # to routing, a replica's context-parallel ranks are more of its shards (same samples)
        self._llm_shape = GroupShape(
            self.llm.module, self.llm.spec.replica_size, self.llm.spec.replicas, self._grad_shard()
        )
        #: each source is sent to every context-parallel rank, as the rows of its tokens there
        self._cp = self.llm.spec.context_parallel

    def _grad_shard(self) -> int:
        """The LLM rank inside a replica whose embedding gradients go back."""
        flags = ray.get(
            [a.returns_input_grads.remote() for a in self.llm.actors[: self.llm.spec.replica_size]]
        )
        if not any(flags):
            raise RuntimeError(f"strategy of module {self.llm.module!r}: no rank returns input gradients")
        return flags.index(True)

    @property
    def llm(self) -> Group:
        return self.groups[-1]

    @property
    def encoders(self) -> list[Group]:
        return self.groups[:-1]

    def group(self, module: str) -> Group:
        return next(g for g in self.groups if g.module == module)

    def route(
        self, samples: list[SampleRefs], cached: dict[int, dict[str, list[Any]]] | None = None
    ) -> Route:
        """``cached``: the samples' modules whose outputs come from a feature cache (no encoder
        rank gets them)."""
        cached = cached or {}
        infos = [
            SampleInfo(
                s.index,
                {
                    m: s.num_media_tokens.get(m, 0)
                    for m in s.inputs
                    if m != "llm" and m not in cached.get(s.index, {})
                },
                s.num_tokens,
            )
            for s in samples
        ]
        return route(infos, self._shapes, self._llm_shape, self.assign)

    def _flight(self, samples: list[SampleRefs]) -> _Flight:
        """A training microbatch, its samples first looked up in the feature caches."""
        cached: dict[int, dict[str, list[Any]]] = {}
        keys: dict[tuple[int, str], str] = {}
        for module, cache in self.caches.items():
            for s in samples:
                digest = s.media_digest.get(module)
                if module not in s.inputs or digest is None:
                    continue  # no media for it, or a source that gives no digest (never cached)
                key = cache.key(digest)
                parts = cache.lookup(key)
                if parts is None:
                    keys[(s.index, module)] = key
                else:
                    cached.setdefault(s.index, {})[module] = parts
        return _Flight(self._next_mb(), samples, self.route(samples, cached), cached=cached, keys=keys)

    def _run_ahead(self, upcoming: list[list[SampleRefs]]) -> None:
        """Each cached encoder encodes the samples of the next batches (up to its ``ahead``) that
        its cache lacks, into the cache, behind this step's own encoder calls: the encoder works
        while the LLM trains, and those samples hit when their step comes. Lookups here are not
        counted (the step that uses an entry counts its hit)."""
        for distance, batch in enumerate(upcoming, 1):
            for module, cache in self.caches.items():
                if cache.ahead < distance:
                    continue
                todo: dict[str, SampleRefs] = {}
                for s in batch:
                    digest = s.media_digest.get(module)
                    if module in s.inputs and digest is not None:
                        key = cache.key(digest)
                        if key not in cache and key not in todo:
                            todo.setdefault(key, s)
                if todo:
                    self._encode_into(module, cache, todo)

    def _encode_into(self, module: str, cache: FeatureCache, todo: dict[str, SampleRefs]) -> None:
        """Encode ``todo`` (key -> sample) on every replica of ``module``'s group (each with its
        share, collectives matched) and keep the outputs; nothing goes to the LLM."""
        g = self.group(module)
        shape = next(s for s in self._shapes if s.module == module)
        infos = [
            SampleInfo(s.index, {module: s.num_media_tokens.get(module, 0)}, s.num_tokens)
            for s in todo.values()
        ]
        r = route(infos, [shape], self._llm_shape, self.assign)
        mb, key_of = self._next_mb(), {s.index: k for k, s in todo.items()}
        by_index = {s.index: s for s in todo.values()}
        for task in r.encodes:
            ids = list(task.samples)
            refs = [by_index[i].inputs[module] for i in ids]
            self._side_refs += g.encode(mb, ids, refs, False, False, ranks=list(task.ranks))
            if ids:
                cache.store([g.actors[rank] for rank in task.ranks], mb, ids, [key_of[i] for i in ids])
        for rank in r.encoded_ranks(module):
            g.actors[rank].drop.remote(mb)

    def _bind_caches(self) -> None:
        """Each cache keys on its group's weights as loaded (after a resume's checkpoint too)."""
        for module, cache in self.caches.items():
            if not cache.bound:
                cache.bind_weights(self._wait([a.weights_digest.remote() for a in self.group(module).actors]))

    # -- one optimizer step ----------------------------------------------------------------------------
    def step(self, batch: list[SampleRefs], ahead: list[list[SampleRefs]] | None = None) -> StepResult:
        """One optimizer step over ``batch``; ``ahead``: the next global batches, which cached
        frozen encoders encode into their caches meanwhile (``feature_cache_ahead``)."""
        t0 = time.perf_counter()
        label_tokens = sum(s.num_label_tokens for s in batch)
        if label_tokens == 0:
            raise ValueError(
                "global batch has no label tokens: nothing to learn from (check the assistant turns)"
            )
        loss_scale = 1.0 / label_tokens
        self._wait([r for g in self.groups for r in g.zero_grad()])
        self._bind_caches()
        flights = []
        for positions in split_microbatches(len(batch), self.microbatches):
            samples = [batch[i] for i in positions]
            if samples:
                flights.append(self._flight(samples))
        frozen = all(g.spec.optim is None for g in self.encoders)
        ops = self.schedule.order(len(flights), max_inflight=self.max_inflight, frozen=frozen)
        check_order(ops, len(flights), max_inflight=self.max_inflight, frozen=frozen, name=self.schedule.name)
        loss_refs: list[Any] = []
        self._last = _last_backwards(ops, flights, self.llm.module)
        for op in ops:
            f = flights[op.mb]
            if op.phase == "forward":
                self._forward(f, train=True)
            elif op.phase == "llm":
                loss_refs += self._llm(f, loss_scale)
            else:
                self._backward(f)
        self._run_ahead(ahead or [])
        self._wait(self._side_refs)  # root causes first: an encoder error, not its consequence in the LLM
        self._side_refs = []
        # every rank runs the reduction collectives; by contract all ranks of a
        # group report the same norm, so rank 0 speaks for its group
        norm_refs = [g.reduce_and_norm() for g in self.groups]
        norms = [n[0] for n in self._wait_nested(norm_refs)]
        grad_norm = math.sqrt(sum(norms))
        coef = clip_coefficient(grad_norm, self.clip_grad_norm)
        records = self._wait_nested([g.step(coef) for g in self.groups])
        loss_sum = sum(self._wait(loss_refs))
        cache_counts = {m: vars(c.settle()) for m, c in self.caches.items()}
        self.steps_done += 1
        return StepResult(
            loss=loss_sum / label_tokens,
            grad_norm=grad_norm,
            label_tokens=label_tokens,
            tokens=sum(s.num_tokens for s in batch),
            step_time_s=time.perf_counter() - t0,
            groups={g.module: reduce_group(r) for g, r in zip(self.groups, records)},
            records={g.module: r for g, r in zip(self.groups, records)},
            module_tokens=self.module_tokens(batch),
            cache=cache_counts,
        )

    def _next_mb(self) -> int:
        self._mb_counter += 1
        return self._mb_counter - 1

    # -- the three phases of a microbatch ----------------------------------------------------------------
    def _forward(self, f: _Flight, *, train: bool) -> None:
        """Every encoder replica with work encodes (``train=False``: in eval
        mode, no graph); each source is fetched as one object addressed to its
        LLM replica."""
        for task in f.route.encodes:
            g = self.group(task.module)
            mine = [s for s in f.samples if s.index in task.samples]  # batch order, as sources expect
            refs, ids = [s.inputs[g.module] for s in mine], [s.index for s in mine]
            grad = train and g.spec.optim is not None
            self._side_refs += g.encode(f.mb, ids, refs, grad, not train, ranks=list(task.ranks))
            keep = [(i, f.keys[(i, g.module)]) for i in ids if (i, g.module) in f.keys]
            keep = [(i, k) for n, (i, k) in enumerate(keep) if k not in self.caches[g.module]]
            if keep:  # a repeat of one key within the microbatch was encoded twice; kept once
                unique = {k: i for i, k in reversed(keep)}
                actors = [g.actors[r] for r in task.ranks]
                self.caches[g.module].store(actors, f.mb, list(unique.values()), list(unique))
        rows = self._cp_rows(f)
        for src in f.route.sources:
            actor = self.group(src.module).actors[src.rank]
            for c in range(self._cp):
                extra = (rows[src.llm_replica], c) if rows else ()
                f.shard_refs[(src.id, c)] = actor.shards_for.options(**self._opts).remote(
                    f.mb, list(src.samples), self._host, *extra
                )

    def _cp_rows(self, f: _Flight) -> dict[int, Any]:
        """Under context parallelism, per LLM replica with sources: a ref to the rows each of its
        context-parallel ranks holds the tokens of (read by the replica's first rank from the
        token ids; :mod:`disagg.kit.context_parallel.routing`); empty without it."""
        if self._cp == 1:
            return {}
        by_index = {s.index: s for s in f.samples}
        out = {}
        for task in f.route.llm:
            totals: dict[int, dict[str, int]] = {}
            for sid in task.sources:
                src = f.route.source(sid)
                for i in src.samples:
                    totals.setdefault(i, {})[src.module] = by_index[i].num_media_tokens[src.module]
            if totals:
                ins = [by_index[i].inputs["llm"] for i in task.samples]
                head = self.llm.actors[task.ranks[0]]
                out[task.replica] = head.cp_rows.remote(list(task.samples), ins, totals)
        return out

    def _cp_slices(self, ranks: tuple[int, ...]) -> list[tuple[int, list[int]]]:
        """A replica's ranks per context-parallel rank (each its ``degree`` TP ranks)."""
        d = len(ranks) // self._cp
        return [(c, list(ranks[c * d : (c + 1) * d])) for c in range(self._cp)]

    def _llm(self, f: _Flight, loss_scale: float) -> list[Any]:
        needs_grad = [g.module for g in self.encoders if g.spec.optim is not None]
        by_index = {s.index: s for s in f.samples}
        loss_refs = []
        for task in f.route.llm:  # every replica, even with no sample: it still runs in step
            ins = [by_index[i].inputs["llm"] for i in task.samples]
            for c, ranks in self._cp_slices(task.ranks):
                # shard refs as top-level arguments: Ray resolves those (RDT included)
                sources: list[tuple] = [(sid, f.route.source(sid).module) for sid in task.sources]
                parts = [f.shard_refs[(sid, c)] for sid in task.sources]
                for i in task.samples:  # cached outputs: one source per encoder rank's entry, no gradient
                    for module, entry in f.cached.get(i, {}).items():
                        sources += [(None, module, i)] * len(entry)
                        parts += entry
                refs = self.llm.loss_and_backward(
                    f.mb,
                    list(task.samples),
                    ins,
                    sources,
                    needs_grad,
                    loss_scale,
                    *parts,
                    ranks=ranks,
                    last=self._last.get((self.llm.module, task.ranks[0])) == f.mb,
                )
                # every TP (and CP: summed over them) rank has the same replica loss; count it once
                loss_refs += refs[:1] if c == 0 else []
                self._side_refs += refs[1:] if c == 0 else refs
        for g in self.encoders:
            if g.spec.optim is None:  # no gradients will come: free the activations now
                for rank in f.route.encoded_ranks(g.module):
                    g.actors[rank].drop.remote(f.mb)
        return loss_refs

    def _backward(self, f: _Flight) -> None:
        """Gradients of each source, from the LLM rank that returns them, to
        exactly the encoder rank that produced it; every rank that encoded
        runs backward (with no gradients if it had no samples)."""
        for g in self.encoders:
            if g.spec.optim is None:
                continue
            for rank in f.route.encoded_ranks(g.module):
                grads = []
                for src in f.route.sources_of(g.module, rank):
                    task = f.route.llm[src.llm_replica]
                    for _, ranks in self._cp_slices(task.ranks):  # each CP rank: the rows it got
                        head = self.llm.actors[ranks[0] + task.grad_rank - task.ranks[0]]
                        call = head.grads_for.options(**self._opts)
                        grads.append(call.remote(f.mb, src.id, self._host, self._cp > 1))
                last = self._last.get((g.module, rank)) == f.mb
                self._side_refs.append(g.actors[rank].backward.remote(f.mb, *grads, last=last))
        for a in self.llm.actors:
            a.release.remote(f.mb)

    # -- evaluation ----------------------------------------------------------------------------------
    def evaluate(self, samples: list[SampleRefs], chunk: int | None = None) -> dict[str, Any]:
        """Teacher-forced loss and greedy token accuracy over every sample, in
        eval mode (no dropout, no graphs kept), routed as training routes.

        The samples go through in chunks of at most ``chunk`` (default: all at
        once; the run uses a training microbatch's size, so evaluation needs no
        more activation memory than a step). The loss is the train loss's
        normalisation over the whole set: the sum over its label tokens divided
        by their count, whatever the chunks. Evaluation's time and collectives
        count toward no training step."""
        t0 = time.perf_counter()
        samples = list(samples)
        if not samples:
            raise ValueError("evaluate: no samples")
        parts = math.ceil(len(samples) / (chunk or len(samples)))
        loss = correct = total = 0.0
        for positions in split_microbatches(len(samples), parts):
            part = [samples[i] for i in positions]
            f = _Flight(self._next_mb(), part, self.route(part))
            self._forward(f, train=False)
            by_index = {s.index: s for s in part}
            outs = []
            for task in f.route.llm:  # every replica, with or without samples (collectives match)
                sources = [(sid, f.route.source(sid).module) for sid in task.sources]
                ins = [by_index[i].inputs["llm"] for i in task.samples]
                for c, ranks in self._cp_slices(task.ranks):  # CP ranks sum the counts: one speaks
                    # top-level: the transport moves them
                    shards = [f.shard_refs[(sid, c)] for sid in task.sources]
                    refs = self.llm.evaluate(list(task.samples), ins, sources, *shards, ranks=ranks)
                    outs += refs[:1] if c == 0 else []
                    self._side_refs += refs[1:] if c == 0 else refs
            for task in f.route.encodes:
                for rank in task.ranks:
                    self.group(task.module).actors[rank].drop.remote(f.mb)
            # one chunk at a time: encoder outputs of the whole set never wait in memory at once
            res = self._wait(outs + self._side_refs)[: len(outs)]
            self._side_refs = []
            loss += sum(x[0] for x in res)
            correct += sum(x[1] for x in res)
            total += sum(x[2] for x in res)
        self._wait([r for g in self.groups for r in g.end_evaluation()])
        return {
            "loss": loss / max(total, 1),
            "token_accuracy": correct / max(total, 1),
            "label_tokens": int(total),
            "samples": len(samples),
            "tokens": self.module_tokens(samples),
            "time_s": time.perf_counter() - t0,
        }

    def module_tokens(self, samples: list[SampleRefs]) -> dict[str, int]:
        """Tokens each module processes for ``samples``: an encoder's placeholder
        tokens (its output rows), the LLM's whole sequences."""
        out = {g.module: sum(s.num_media_tokens.get(g.module, 0) for s in samples) for g in self.encoders}
        out[self.llm.module] = sum(s.num_tokens for s in samples)
        return out

    # -- state -------------------------------------------------------------------------------------------
    def full_state_dict(self, module: str) -> dict[str, Any]:
        return self._wait(self.group(module).full_state_dict())[0]

    def full_grads(self, module: str) -> dict[str, Any]:
        return self._wait(self.group(module).full_grads())[0]

    def save_full(self, path: str, sharded: bool = False) -> dict[str, dict[str, Any]]:
        """Every group writes its part of a checkpoint in the full form under
        ``path`` (``sharded``: each rank its own pieces); returns each written
        file's checksum by relative path."""
        files: dict[str, dict[str, Any]] = {}
        for part in self._wait([r for g in self.groups for r in g.save_full(path, sharded)]):
            files.update(part)
        return files

    def load_full(self, path: str, restore_rng: dict[str, bool]) -> None:
        """Every rank takes its part of the full form; ``restore_rng[module]``:
        the group's layout is the checkpoint's, so each rank continues its
        saved random streams."""
        self._wait([r for g in self.groups for r in g.load_full(path, restore_rng[g.module])])

    def placement(self) -> dict[str, list[str]]:
        return {g.module: list(g.nodes) for g in self.groups}

    def shutdown(self) -> None:
        if self.transport is not None:
            self.transport.teardown([a for g in self.groups for a in g.actors])
        stop_groups(self.groups)

    # -- waiting -----------------------------------------------------------------------------------------
    def _wait(self, refs: list[Any]) -> list[Any]:
        """``ray.get`` that fails on the first error to arrive (ranks blocked in
        a collective with a dead peer would otherwise hide it until their
        timeout), and on a stall: no call finishing for ``stall_s``."""
        try:
            return wait_all(refs, self.stall_s)
        except GroupFailure as exc:
            exc.args = (f"step {self.steps_done + 1}: {exc}",)  # keeps the subclass (ActorDied)
            raise exc from None

    def _wait_nested(self, groups: list[list[Any]]) -> list[list[Any]]:
        flat = self._wait([r for g in groups for r in g])
        out, k = [], 0
        for g in groups:
            out.append(flat[k : k + len(g)])
            k += len(g)
        return out


__all__ = ["ActorDied", "GroupFailure", "Orchestrator", "actor_failure", "wait_all"]


def _last_backwards(ops: list[Any], flights: list[_Flight], llm: str) -> dict[tuple[str, int], int]:
    """``(module, rank) -> microbatch`` of each rank's last backward this step, in schedule order:
    a strategy that reduces gradients while backward runs starts with that one (only then are its
    gradients final)."""
    last: dict[tuple[str, int], int] = {}
    for op in ops:
        f = flights[op.mb]
        if op.phase == "llm":
            for task in f.route.llm:
                for r in task.ranks:
                    last[(llm, r)] = f.mb
        elif op.phase == "backward":
            for module in {t.module for t in f.route.encodes}:
                for r in f.route.encoded_ranks(module):
                    last[(module, r)] = f.mb
    return last
