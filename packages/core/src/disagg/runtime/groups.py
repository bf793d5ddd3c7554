"""Module groups: Ray actors, their placement, and their ``torch.distributed`` worlds."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import ObjectRef
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from disagg.interfaces import Family, OptimSpec, StrategyOptions
from disagg.kit import Strategy
from disagg.runtime.actor.spec import WorkerSpec
from disagg.runtime.actor.worker import ModuleWorker


@dataclass
class GroupSpec:
    """Everything needed to start one module's group."""

    module: str
    family: Family
    strategy_cls: type[Strategy]
    options: StrategyOptions
    degree: int
    replicas: int
    optim: OptimSpec | None
    num_cpus: float = 1.0
    num_gpus: float | None = None
    #: ranks of a replica splitting each sample's sequence (``parallel.<m>.context_parallel``)
    context_parallel: int = 1

    @property
    def replica_size(self) -> int:
        """Ranks that read the same samples: ``degree * context_parallel``."""
        return self.degree * self.context_parallel

    @property
    def size(self) -> int:
        return self.replica_size * self.replicas


@dataclass
class Group:
    """One module's ranks. The driver reaches them only through the typed
    methods below, one per :class:`ModuleWorker` method it calls on a whole group
    (their signatures are the worker's, checked by a test); each submits the call
    to the given ranks (all by default) and returns their ObjectRefs."""

    spec: GroupSpec
    actors: list[Any]
    placement: PlacementGroup | None = None
    nodes: list[str] = field(default_factory=list)
    #: each rank's Ray actor id (hex), as the rank itself reports it
    actor_ids: list[str] = field(default_factory=list)

    @property
    def module(self) -> str:
        return self.spec.module

    def _on(self, ranks: list[int] | None) -> list[Any]:
        return self.actors if ranks is None else [self.actors[r] for r in ranks]

    # -- set-up ------------------------------------------------------------------------------------
    def setup(self, master_addr: str, master_port: int) -> list[ObjectRef]:
        return [a.setup.remote(master_addr, master_port) for a in self.actors]

    def placements(self) -> list[ObjectRef]:
        """Each rank's :meth:`ModuleWorker.placement` (node, pid, GPUs, actor id)."""
        return [a.placement.remote() for a in self.actors]

    # -- one step ----------------------------------------------------------------------------------
    def zero_grad(self) -> list[ObjectRef]:
        return [a.zero_grad.remote() for a in self.actors]

    def encode(
        self,
        mb: int,
        sample_ids: list[int],
        input_refs: list[Any],
        grad: bool = True,
        evaluating: bool = False,
        *,
        ranks: list[int] | None = None,
    ) -> list[ObjectRef]:
        return [a.encode.remote(mb, sample_ids, input_refs, grad, evaluating) for a in self._on(ranks)]

    def loss_and_backward(
        self,
        mb: int,
        sample_ids: list[int],
        input_refs: list[Any],
        sources: list[tuple[int, str]],
        needs_grad: list[str],
        loss_scale: float,
        *parts: Any,
        last: bool = False,
        ranks: list[int] | None = None,
    ) -> list[ObjectRef]:
        return [
            a.loss_and_backward.remote(
                mb, sample_ids, input_refs, sources, needs_grad, loss_scale, *parts, last=last
            )
            for a in self._on(ranks)
        ]

    def reduce_and_norm(self) -> list[ObjectRef]:
        return [a.reduce_and_norm.remote() for a in self.actors]

    def step(self, clip_coef: float) -> list[ObjectRef]:
        return [a.step.remote(clip_coef) for a in self.actors]

    # -- evaluation --------------------------------------------------------------------------------
    def evaluate(
        self,
        sample_ids: list[int],
        input_refs: list[Any],
        sources: list[tuple[int, str]],
        *parts: Any,
        ranks: list[int] | None = None,
    ) -> list[ObjectRef]:
        return [a.evaluate.remote(sample_ids, input_refs, sources, *parts) for a in self._on(ranks)]

    def end_evaluation(self) -> list[ObjectRef]:
        return [a.end_evaluation.remote() for a in self.actors]

    # -- state -------------------------------------------------------------------------------------
    def full_state_dict(self) -> list[ObjectRef]:
        return [a.full_state_dict.remote() for a in self.actors]

    def full_grads(self) -> list[ObjectRef]:
        return [a.full_grads.remote() for a in self.actors]

    def save_full(self, ckpt: str, sharded: bool = False) -> list[ObjectRef]:
        return [a.save_full.remote(ckpt, sharded) for a in self.actors]

    def load_full(self, ckpt: str, restore_rng: bool) -> list[ObjectRef]:
        return [a.load_full.remote(ckpt, restore_rng) for a in self.actors]


def start_groups(
    specs: list[GroupSpec],
    *,
    placement: str,
    device: str,
    precision: str,
    seed: int,
    collective_timeout_s: float = 600.0,
    start_timeout_s: float = 900.0,
    placement_timeout_s: float | None = None,
) -> list[Group]:
    """Create placement groups and actors, then each group's process group.
    Raises :class:`StartTimeout` naming the module when its placement group is
    not placed within ``placement_timeout_s`` (default ``start_timeout_s``; the
    run's embedded Ray gives a short one: its resources never grow) or its ranks'
    set-up does not finish within ``start_timeout_s``."""
    remote_cls = ray.remote(enable_tensor_transport=True)(ModuleWorker)
    gpus = device == "cuda"
    wait = start_timeout_s if placement_timeout_s is None else placement_timeout_s
    if placement == "collocated":
        pgs, bundle_of = _collocated(specs, gpus, wait)
    else:
        pgs, bundle_of = _disaggregated(specs, gpus, wait)
    groups = []
    for gi, spec in enumerate(specs):
        pg_index = 0 if placement == "collocated" else gi
        actors = []
        for rank in range(spec.size):
            num_gpus = _gpus_per_rank(spec, specs, placement, rank) if gpus else 0
            actors.append(
                remote_cls.options(
                    num_cpus=spec.num_cpus,
                    num_gpus=num_gpus,
                    name=None,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pgs[pg_index], placement_group_bundle_index=bundle_of(gi, rank)
                    ),
                ).remote(
                    WorkerSpec(
                        module=spec.module,
                        rank=rank,
                        world_size=spec.size,
                        degree=spec.degree,
                        replicas=spec.replicas,
                        context_parallel=spec.context_parallel,
                        family=spec.family,
                        strategy_cls=spec.strategy_cls,
                        options=spec.options,
                        optim=spec.optim,
                        device=device,
                        precision=precision,
                        seed=seed,
                        collective_timeout_s=collective_timeout_s,
                    )
                )
            )
        groups.append(Group(spec, actors, pgs[pg_index]))
    # Start every group's torch.distributed world concurrently: set-up of one
    # group blocks until all its ranks have joined.
    try:
        setups: dict[Any, tuple[Group, int]] = {}
        deadline = time.monotonic() + start_timeout_s
        for g in groups:
            [(addr, port)] = _get_by(deadline, {g.actors[0].rendezvous.remote(): (g, 0)}, start_timeout_s)
            setups.update({ref: (g, r) for r, ref in enumerate(g.setup(addr, port))})
        _get_by(deadline, setups, start_timeout_s)
        for g in groups:
            where = ray.get(g.placements())
            g.nodes = [p["node_id"] for p in where]
            g.actor_ids = [p["actor_id"] for p in where]
    except BaseException:
        stop_groups(groups)  # nothing may keep holding the cluster's resources
        raise
    return groups


class StartTimeout(RuntimeError):
    """A group's actors were not placed or set up in time (``parallel.start_timeout_s``)."""


def _get_by(deadline: float, refs: dict[Any, tuple[Group, int]], timeout_s: float) -> list[Any]:
    """``ray.get`` of ``refs`` (ref -> its group and rank) by ``deadline``;
    :class:`StartTimeout` names the ranks that had not finished."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if ready:
            ray.get(ready)  # a rank that failed to set up says why now, not after its peers time out
        elif pending:
            late: dict[str, list[int]] = {}
            for ref in pending:
                g, rank = refs[ref]
                late.setdefault(g.module, []).append(rank)
            (module, ranks), *_ = late.items()
            spec = next(g.spec for g, _ in refs.values() if g.module == module)
            raise StartTimeout(
                f"module {module!r} ranks {sorted(ranks)} did not finish starting within {timeout_s:g} s "
                f"(parallel.start_timeout_s): not placed (each asks num_cpus={spec.num_cpus:g}, "
                f"num_gpus={spec.num_gpus if spec.num_gpus is not None else 'default'}; the cluster has "
                f"{_free()} free) or still loading weights (then raise the timeout)"
            )
    return ray.get(list(refs))


def _free() -> str:
    free = ray.available_resources()
    return ", ".join(f"{k} {free.get(k, 0):g}" for k in ("CPU", "GPU"))


def _ready(
    pg: PlacementGroup, module: str, bundles: list[dict[str, float]], timeout_s: float, keys: str
) -> None:
    """Wait for ``pg``; :class:`StartTimeout` names the module, what it asked and the
    config ``keys`` that asked for it."""
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        gpu = any("GPU" in b for b in bundles)
        raise StartTimeout(
            f"the placement group of {module} ({len(bundles)} bundles, e.g. {bundles[0]}) was not placed "
            f"within {timeout_s:g} s (parallel.start_timeout_s); the cluster has {_free()} free and "
            f"{_total()} in all: lower {keys}"
            + (" (GPUs: train.device: cuda)" if gpu else "")
            + ", or add nodes"
        )


def _asked(specs: list[GroupSpec]) -> str:
    """The config keys behind a placement's bundles."""
    keys = [f"parallel.{s.module}.resources.num_cpus / num_gpus, .degree, .replicas" for s in specs]
    return "; ".join(keys)


def _total() -> str:
    total = ray.cluster_resources()
    return ", ".join(f"{k} {total.get(k, 0):g}" for k in ("CPU", "GPU"))


def _gpus_per_rank(spec: GroupSpec, specs: list[GroupSpec], placement: str, rank: int) -> float:
    if spec.num_gpus is not None:
        return spec.num_gpus
    if placement == "disaggregated":
        return 1.0
    # collocated: the ranks on bundle `rank`'s GPU without a share of their own
    # split evenly what the explicit shares leave (validation refuses sums past 1)
    members = [s for s in specs if s.size > rank]
    taken = sum(s.num_gpus for s in members if s.num_gpus is not None)
    rest = sum(1 for s in members if s.num_gpus is None)
    return max(0.0, 1.0 - taken) / max(rest, 1)


def _collocated(specs: list[GroupSpec], gpus: bool, timeout_s: float):
    """One bundle per device index; rank i of every group lives in bundle i."""
    n = max(s.size for s in specs)
    bundles = []
    for i in range(n):
        members = [s for s in specs if s.size > i]
        b: dict[str, float] = {"CPU": sum(s.num_cpus for s in members)}
        if gpus:
            b["GPU"] = 1.0
        bundles.append(b)
    pg = placement_group(bundles, strategy="PACK")
    _ready(
        pg,
        "the collocated groups " + ", ".join(repr(s.module) for s in specs),
        bundles,
        timeout_s,
        _asked(specs),
    )
    return [pg], (lambda gi, rank: rank)


def _disaggregated(specs: list[GroupSpec], gpus: bool, timeout_s: float):
    """A placement group per module, each aimed at a node no other group took
    (when the cluster has enough nodes), so groups never share devices."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    free = {n["NodeID"]: dict(n.get("Resources", {})) for n in alive}
    taken: set[str] = set()
    pgs = []
    for spec in specs:
        need_cpu = spec.num_cpus * spec.size
        need_gpu = (spec.num_gpus or 1.0) * spec.size if gpus else 0.0
        target = next(
            (
                nid
                for nid, r in free.items()
                if nid not in taken and r.get("CPU", 0) >= need_cpu and r.get("GPU", 0) >= need_gpu
            ),
            None,
        )
        bundle: dict[str, float] = {"CPU": spec.num_cpus}
        if gpus:
            bundle["GPU"] = spec.num_gpus or 1.0
        # Ray honours a target node only for STRICT_PACK; a group too big for
        # any single free node falls back to PACK anywhere.
        bundles = [dict(bundle) for _ in range(spec.size)]
        strategy = "STRICT_PACK" if target else "PACK"
        pg = placement_group(bundles, strategy=strategy, _soft_target_node_id=target)
        try:
            _ready(pg, f"module {spec.module!r}", bundles, timeout_s, _asked([spec]))
        except StartTimeout:
            for earlier in pgs:
                remove_placement_group(earlier)
            raise
        if target:
            taken.add(target)
            free[target]["CPU"] -= need_cpu
            if gpus:
                free[target]["GPU"] = free[target].get("GPU", 0) - need_gpu
        pgs.append(pg)
    return pgs, (lambda gi, rank: rank)


def stop_groups(groups: list[Group]) -> None:
    """Tear down process groups, kill actors and free their placement groups."""
    try:
        ray.get([a.shutdown.remote() for g in groups for a in g.actors], timeout=30)
    except Exception:  # a dead actor cannot shut down; killing it below is enough
        pass
    seen = set()
    for g in groups:
        for a in g.actors:
            ray.kill(a)
        if g.placement is not None and id(g.placement) not in seen:
            seen.add(id(g.placement))
            remove_placement_group(g.placement)
