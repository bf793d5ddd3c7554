"""The driver's step: encoders forward, LLM forward+backward, gradients routed
back to the exact encoder rank that produced each shard, one global clip, and
an optimizer step in every group. The driver holds ObjectRefs and small
numbers only."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import ray

from disagg.data.types import SampleRefs
from disagg.interfaces.strategy import clip_coefficient
from disagg.runtime.groups import Group, GroupSpec, start_groups, stop_groups
from disagg.runtime.routing import assign, split_microbatches


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    label_tokens: int
    tokens: int
    step_time_s: float
    groups: dict[str, dict[str, Any]]


class Orchestrator:
    """Drives the groups of one run through training steps."""

    def __init__(
        self,
        specs: list[GroupSpec],
        *,
        placement: str = "collocated",
        device: str = "cpu",
        dtype: str = "float32",
        seed: int = 0,
        microbatches: int = 1,
        clip_grad_norm: float | None = None,
        transport: Any = None,
        collective_timeout_s: float = 600.0,
    ) -> None:
        if not specs or specs[-1].family.role != "llm":
            raise ValueError("the last group must be the language model")
        self.specs = specs
        self.microbatches = microbatches
        self.clip_grad_norm = clip_grad_norm
        self.groups: list[Group] = start_groups(
            specs,
            placement=placement,
            device=device,
            dtype=dtype,
            seed=seed,
            collective_timeout_s=collective_timeout_s,
        )
        self.transport = transport
        if transport is not None:
            transport.setup([a for g in self.groups for a in g.actors])
        self._opts = transport.call_options() if transport is not None else {}
        self._mb_counter = 0
        self._side_refs: list[Any] = []
        global _ACTOR_NAMES
        _ACTOR_NAMES.update(
            {
                a._actor_id.hex(): f"module {g.module!r} rank {r}"
                for g in self.groups
                for r, a in enumerate(g.actors)
            }
        )

    @property
    def llm(self) -> Group:
        return self.groups[-1]

    @property
    def encoders(self) -> list[Group]:
        return self.groups[:-1]

    def group(self, module: str) -> Group:
        return next(g for g in self.groups if g.module == module)

    # -- one optimizer step ----------------------------------------------------------------------------
    def step(self, batch: list[SampleRefs]) -> StepResult:
        t0 = time.perf_counter()
        label_tokens = sum(s.num_label_tokens for s in batch)
        if label_tokens == 0:
            raise ValueError(
                "global batch has no label tokens: nothing to learn from (check the assistant turns)"
            )
        loss_scale = 1.0 / label_tokens
        _wait([r for g in self.groups for r in g.call("zero_grad")])
        loss_refs: list[Any] = []
        for positions in split_microbatches(len(batch), self.microbatches):
            mb = [batch[i] for i in positions]
            if mb:
                loss_refs += self._microbatch(mb, loss_scale)
        _wait(self._side_refs)  # root causes first: an encoder error, not its consequence in the LLM
        self._side_refs = []
        # every rank runs the reduction collectives; by contract all ranks of a
        # group report the same norm, so rank 0 speaks for its group
        all_norms = [g.call("reduce_and_norm") for g in self.groups]
        norms = [n[0] for n in _wait_nested(all_norms)]
        grad_norm = math.sqrt(sum(norms))
        coef = clip_coefficient(grad_norm, self.clip_grad_norm)
        per_rank = _wait([r for g in self.groups for r in g.call("step", coef)])
        loss_sum = sum(_wait(loss_refs))
        metrics, k = {}, 0
        for g in self.groups:
            ranks = per_rank[k : k + len(g.actors)]
            k += len(g.actors)
            metrics[g.module] = {
                "peak_mem_bytes": max(r["peak_mem_bytes"] for r in ranks),
                "comm_bytes": sum(r["comm_bytes"] for r in ranks),
                "comm_bytes_per_rank": max(r["comm_bytes"] for r in ranks),
                "time_s": max(r["busy_s"] for r in ranks),
                "activation_bytes_per_rank": max(r["activation_bytes"] for r in ranks),
                "state_bytes_per_rank": max(r["state_bytes"] for r in ranks),
                "lr": ranks[0]["lr"],
            }
        return StepResult(
            loss=loss_sum / label_tokens,
            grad_norm=grad_norm,
            label_tokens=label_tokens,
            tokens=sum(s.num_tokens for s in batch),
            step_time_s=time.perf_counter() - t0,
            groups=metrics,
        )

    def _microbatch(self, mb: list[SampleRefs], loss_scale: float) -> list[Any]:
        mb_id = self._mb_counter
        self._mb_counter += 1
        ids = [s.index for s in mb]
        llm_owner = {}  # sample id -> LLM replica
        llm_parts = assign(len(mb), self.llm.spec.replicas)
        for r, part in enumerate(llm_parts):
            for p in part:
                llm_owner[ids[p]] = r
        # encoders: forward, then one shard object per (encoder rank, LLM replica)
        shard_refs: dict[int, list[tuple[str, Any, Group, int]]] = {r: [] for r in range(len(llm_parts))}
        encoded: dict[str, list[int]] = {}  # module -> ranks that ran encode for this microbatch
        for g in self.encoders:
            with_media = [s for s in mb if g.module in s.inputs]
            if not with_media:
                continue  # every rank of the group skips alike: no collective is left waiting
            # Every replica is called, even with no samples: strategies that
            # communicate inside forward/backward (ZeRO-3) need every rank in step.
            for r, part in enumerate(assign(len(with_media), g.spec.replicas)):
                samples = [with_media[p] for p in part]
                sids = [s.index for s in samples]
                refs = [s.inputs[g.module] for s in samples]
                ranks = list(range(r * g.spec.degree, (r + 1) * g.spec.degree))
                self._side_refs += g.call("encode", mb_id, sids, refs, ranks=ranks)
                encoded.setdefault(g.module, []).extend(ranks)
                for llm_r in range(len(llm_parts)):
                    wanted = [i for i in sids if llm_owner[i] == llm_r]
                    if not wanted:
                        continue
                    for rank in ranks:
                        ref = g.actors[rank].shards_for.options(**self._opts).remote(mb_id, wanted)
                        shard_refs[llm_r].append((g.module, ref, g, rank))
        # language model: forward + backward on each replica
        needs_grad = [g.module for g in self.encoders if g.spec.optim is not None]
        loss_refs = []
        for r, part in enumerate(llm_parts):
            samples = [mb[p] for p in part]  # possibly none: the replica still runs in step
            sids = [s.index for s in samples]
            ins = [s.inputs["llm"] for s in samples]
            srcs = [(m, ref) for m, ref, _, _ in shard_refs[r]]
            ranks = list(range(r * self.llm.spec.degree, (r + 1) * self.llm.spec.degree))
            refs = self.llm.call(
                "loss_and_backward", mb_id, sids, ins, srcs, needs_grad, loss_scale, ranks=ranks
            )
            loss_refs.append(refs[0])  # every TP rank computes the same replica loss; count it once
            self._side_refs += refs[1:]
        # gradients back to the rank that produced each shard
        grads_to: dict[tuple[str, int], list[Any]] = {}
        for r, entries in shard_refs.items():
            head = self.llm.actors[r * self.llm.spec.degree]
            for src, (module, _, g, rank) in enumerate(entries):
                if g.spec.optim is None:
                    continue
                grads_to.setdefault((module, rank), []).append(
                    head.grads_for.options(**self._opts).remote(mb_id, module, src)
                )
        for g in self.encoders:
            for rank in encoded.get(g.module, []):
                if g.spec.optim is None:
                    g.actors[rank].drop.remote(mb_id)
                else:  # every rank that encoded runs backward, with no gradients if it had no samples
                    self._side_refs.append(
                        g.actors[rank].backward.remote(mb_id, grads_to.get((g.module, rank), []))
                    )
        for a in self.llm.actors:
            a.release.remote(mb_id)
        return loss_refs

    # -- evaluation ----------------------------------------------------------------------------------
    def evaluate(self, batch: list[SampleRefs]) -> dict[str, float]:
        """Teacher-forced loss and greedy token accuracy on label tokens."""
        mb_id = self._mb_counter
        self._mb_counter += 1
        ids = [s.index for s in batch]
        llm_parts = assign(len(batch), self.llm.spec.replicas)
        owner = {ids[p]: r for r, part in enumerate(llm_parts) for p in part}
        srcs: dict[int, list[tuple[str, Any]]] = {r: [] for r in range(len(llm_parts))}
        for g in self.encoders:
            with_media = [s for s in batch if g.module in s.inputs]
            if not with_media:
                continue
            for r, part in enumerate(assign(len(with_media), g.spec.replicas)):
                samples = [with_media[p] for p in part]  # every replica runs, as in training
                sids = [s.index for s in samples]
                ranks = list(range(r * g.spec.degree, (r + 1) * g.spec.degree))
                g.call("encode", mb_id, sids, [s.inputs[g.module] for s in samples], ranks=ranks)
                for llm_r in range(len(llm_parts)):
                    wanted = [i for i in sids if owner[i] == llm_r]
                    for rank in ranks if wanted else []:
                        srcs[llm_r].append((g.module, g.actors[rank].shards_for.remote(mb_id, wanted)))
                for rank in ranks:
                    g.actors[rank].drop.remote(mb_id)
        outs = []
        for r, part in enumerate(llm_parts):
            samples = [batch[p] for p in part]
            ranks = list(range(r * self.llm.spec.degree, (r + 1) * self.llm.spec.degree))
            outs.append(
                self.llm.call(
                    "evaluate",
                    [s.index for s in samples],
                    [s.inputs["llm"] for s in samples],
                    srcs[r],
                    ranks=ranks,
                )[0]
            )
        res = _wait(outs)
        loss, correct, total = (sum(x[i] for x in res) for i in range(3))
        return {
            "loss": loss / max(total, 1),
            "token_accuracy": correct / max(total, 1),
            "label_tokens": total,
        }

    # -- state -------------------------------------------------------------------------------------------
    def full_state_dict(self, module: str) -> dict[str, Any]:
        g = self.group(module)
        return _wait(g.call("full_state_dict"))[0]

    def full_grads(self, module: str) -> dict[str, Any]:
        g = self.group(module)
        return _wait(g.call("full_grads"))[0]

    def save(self, path: str) -> None:
        _wait([r for g in self.groups for r in g.call("save", f"{path}/{g.module}")])

    def load(self, path: str) -> None:
        _wait([r for g in self.groups for r in g.call("load", f"{path}/{g.module}")])

    def placement(self) -> dict[str, list[str]]:
        return {g.module: list(g.nodes) for g in self.groups}

    def shutdown(self) -> None:
        if self.transport is not None:
            self.transport.teardown([a for g in self.groups for a in g.actors])
        stop_groups(self.groups)


class GroupFailure(RuntimeError):
    """A rank of a module group failed; the message names module and rank."""


def _wait(refs: list[Any]) -> list[Any]:
    """``ray.get`` that fails on the first error to arrive (ranks blocked in a
    collective with a dead peer would otherwise hide it until their timeout)."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(ready[0])
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            raise GroupFailure(_last_line(cause)) from None
        except ray.exceptions.RayActorError as exc:
            who = _ACTOR_NAMES.get(getattr(exc, "actor_id", None) or "", "an actor of unknown module")
            raise GroupFailure(f"{who} died: {_last_line(exc)}") from None
    return ray.get(list(refs))


#: actor id (hex) -> "module 'x' rank n", so a dead process is reported by name
_ACTOR_NAMES: dict[str, str] = {}


def _wait_nested(groups: list[list[Any]]) -> list[list[Any]]:
    flat = _wait([r for g in groups for r in g])
    out, k = [], 0
    for g in groups:
        out.append(flat[k : k + len(g)])
        k += len(g)
    return out


def _last_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    named = [ln for ln in lines if "module '" in ln and "rank" in ln]
    return (named[-1] if named else (lines[-1] if lines else repr(exc))).strip()
