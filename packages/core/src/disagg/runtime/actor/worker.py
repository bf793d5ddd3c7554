"""The Ray actor that holds one rank of one module group.

It owns a ``torch.distributed`` world shared only with the other ranks of its
module, a :class:`~disagg.kit.Strategy`, and the autograd graphs of the
microbatches in flight. Every method that moves activations or gradients
returns exactly one object (what Ray Direct Transport supports), addressed to
one consumer, so the driver only wires ObjectRefs and never sees tensors; the
consumer takes them as top-level arguments (Ray resolves those, over RDT too,
which neither transfers refs nested in lists nor allows ``ray.get`` on a
two-sided transport's refs).
"""

from __future__ import annotations

import functools
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import ray
import torch
import torch.distributed as dist

from disagg.interfaces import (
    RECIPES,
    EmbeddingShard,
    GroupContext,
    dropout_seed,
)
from disagg.kit import Strategy
from disagg.kit.context_parallel import routing as cp_routing
from disagg.kit.context_parallel.routing import RankRows
from disagg.kit.lora import apply_lora
from disagg.kit.masters import cast_inputs
from disagg.metrics.record import RankRecord
from disagg.runtime.actor import host_memory
from disagg.runtime.actor.accounting import Accounting
from disagg.runtime.actor.errors import WorkerError, worker_error
from disagg.runtime.actor.process_group import init_group
from disagg.runtime.actor.spec import WorkerSpec
from disagg.runtime.feature_cache import read_part

__all__ = ["ModuleWorker", "WorkerError", "WorkerSpec"]


def _named(fn: Callable) -> Callable:
    # Errors must name the module and rank; Ray alone reports an opaque actor id.
    @functools.wraps(fn)
    def wrapper(self: ModuleWorker, *args: Any, **kwargs: Any) -> Any:
        with self.acct.call(fn.__name__):
            try:
                return fn(self, *args, **kwargs)
            except WorkerError:
                raise
            except Exception as exc:
                ctx = getattr(self.strategy, "ctx", None)
                raise worker_error(
                    exc, self.module, self.rank, ctx.comm if ctx is not None else None
                ) from exc

    return wrapper


def _for_wire(t: torch.Tensor, host: bool) -> torch.Tensor:
    """A tensor that owns exactly its bytes: through the object store a view
    would pickle its whole storage (the encoder's full output); ``host``: sent
    from host memory (object store), else it stays on its device (RDT)."""
    t = t.detach()
    if host and t.device.type != "cpu":
        return t.cpu().contiguous()
    return t.clone(memory_format=torch.contiguous_format) if host else t.contiguous()


class ModuleWorker:
    """One rank of a module group (instantiated as a Ray actor by ``groups``)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.module, self.rank = spec.module, spec.rank
        self.world_size, self.degree, self.replicas = spec.world_size, spec.degree, spec.replicas
        self.family, self.strategy_cls, self.options = spec.family, spec.strategy_cls, spec.options
        self.optim, self.seed = spec.optim, spec.seed
        self.collective_timeout = timedelta(seconds=spec.collective_timeout_s)
        self.device_kind, self.precision = spec.device, spec.precision
        self.strategy: Strategy | None = None
        # microbatch -> (sample ids, shards) kept until their gradients arrive
        self.pending: dict[int, tuple[list[int], list[EmbeddingShard]]] = {}
        # microbatch -> (sample ids, embedding leaves per sample, source id -> [(sample, positions)])
        self.llm_leaves: dict[int, tuple[list[int], list[dict[str, torch.Tensor]], dict[int, list]]] = {}
        #: this step's figures (times, bytes), handed back by step()
        self.acct = Accounting(spec.module, spec.rank, spec.device == "cuda")

    # -- set-up -------------------------------------------------------------------------------------
    def rendezvous(self) -> tuple[str, int]:
        """Address and a free port for this group's ``torch.distributed`` store (rank 0)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def host_memory(self) -> dict[str, int]:
        """Host memory of this rank's set-up (bytes): ``hwm`` its peak resident size,
        ``setup_peak`` the peak's rise over the start, ``rss_before``/``rss_after``."""
        return dict(self.setup_memory)

    def placement(self) -> dict[str, Any]:
        """Where this rank runs: node, process, GPUs, and its actor id (hex, from Ray's
        public runtime context), by which the driver names a rank whose process died."""
        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "pid": os.getpid(),
            "gpu_ids": ray.get_gpu_ids(),
            "actor_id": ctx.get_actor_id(),
        }

    @_named
    def setup(self, master_addr: str, master_port: int) -> None:
        import transformers

        # one progress bar per rank per weight file drowns the driver's training bar
        transformers.utils.logging.disable_progress_bar()
        device = init_group(
            self.device_kind, master_addr, master_port, self.rank, self.world_size, self.collective_timeout
        )
        torch.manual_seed(self.seed)
        recipe = RECIPES[self.precision]
        ctx = GroupContext(
            self.module,
            self.rank,
            self.world_size,
            self.degree,
            self.replicas,
            device,
            recipe.weights,
            seed=self.seed,
            collective_timeout=self.collective_timeout,
            recipe=recipe,
            context_parallel=self.spec.context_parallel,
        )
        self.strategy = self.strategy_cls(ctx, self.family, self.options)
        memory = host_memory.start()
        # Weights load in fp32; the strategy's setup casts them to the recipe's (keeping fp32
        # masters under bf16): no autocast anywhere.
        # the strategy builds: the whole module, or a partitioned or empty one
        module = self.strategy.build_module()
        if (
            self.optim is not None
            and self.optim.lora is not None
            and not getattr(self.strategy_cls, "lora_step", False)
        ):
            # adapters before parallelization: the strategy sees which weights train; on a
            # module built empty they are drawn on the CPU and its base stays empty (lora.py);
            # a strategy with lora_step applies them to its own layers in parallelize
            module = apply_lora(module, self.optim.lora, self.module, f"train.modules.{self.module}.lora")
        self.strategy.setup(module, self.optim)
        #: this rank's host memory over the set-up (``host_memory.finish``)
        self.setup_memory = host_memory.finish(memory)
        # from_pretrained leaves a model in eval mode; training runs its dropout.
        self.strategy.module.train()  # type: ignore[union-attr]
        # Weights were built under one seed on every rank; dropout draws from
        # here on, and replicas (different samples) must draw different masks.
        torch.manual_seed(dropout_seed(self.seed, ctx.replica))

    # -- encoder role -------------------------------------------------------------------------------
    @_named
    def encode(
        self,
        mb: int,
        sample_ids: list[int],
        input_refs: list[Any],
        grad: bool = True,
        evaluating: bool = False,
    ) -> None:
        """Forward this rank's shard of each sample; outputs stay here until
        fetched. ``grad=False`` (evaluation, a frozen encoder) keeps no graph;
        ``evaluating`` runs the module in eval mode (no dropout)."""
        # pixels / audio features in the compute dtype (the recipe's weights; nothing autocasts)
        dtype = self.strategy.ctx.dtype  # type: ignore[union-attr]
        inputs = [cast_inputs(x, dtype) for x in ray.get(input_refs)]
        module = self.strategy.module  # type: ignore[union-attr]
        if evaluating:
            module.eval()
        try:
            with self._count_saved(mb), torch.set_grad_enabled(grad):
                shards = self.strategy.encode(mb, inputs)  # type: ignore[union-attr]
        finally:
            if evaluating:
                module.train()
        if len(shards) != len(sample_ids):
            raise RuntimeError(f"strategy returned {len(shards)} shards for {len(sample_ids)} samples")
        self.pending[mb] = (list(sample_ids), shards)
        if sample_ids:
            self.acct.record.encode_calls += 1

    @_named
    def cache_out(self, mb: int, sample_ids: list[int], paths: list[str] | None = None) -> Any:
        """This rank's ``(positions, value, total)`` of each of ``sample_ids``, exactly as
        :meth:`shards_for` sends them from host memory, for the feature cache
        (:mod:`disagg.runtime.feature_cache`): one object per sample and then their sizes in
        bytes; with ``paths``, each written to its file instead, and only the sizes returned."""
        from disagg.runtime.feature_cache import part_bytes, write_part

        ids, shards = self.pending[mb]
        by_id = dict(zip(ids, shards))
        parts = []
        for i in sample_ids:
            s = by_id[i]
            value = _for_wire(s.value, True)
            parts.append((s.positions.cpu(), value, s.total))
        if paths is not None:
            return [write_part(p, part) for p, part in zip(paths, parts)]
        return (*parts, [part_bytes(p) for p in parts])

    def weights_digest(self) -> str:
        """A digest of this rank's module state as loaded (a feature cache key's weights part)."""
        from disagg.runtime.feature_key import state_digest

        return state_digest(self.strategy.module)  # type: ignore[union-attr,arg-type]

    @_named
    def shards_for(
        self,
        mb: int,
        sample_ids: list[int],
        host: bool = True,
        rows: RankRows | None = None,
        cp_rank: int = 0,
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor, int]]:
        """This rank's shards of ``sample_ids`` — one object for one LLM
        replica, every tensor in it on one device (RDT requires it): the
        value's, or host memory when ``host`` (the object store). ``rows``
        (an LLM under context parallelism): only the rows its context-parallel
        rank ``cp_rank`` holds the tokens of (:mod:`disagg.kit.context_parallel.routing`)."""
        ids, shards = self.pending[mb]
        by_id = dict(zip(ids, shards))
        out = {}
        for i in sample_ids:
            s = by_id[i]
            # a sample with no row on this rank still gets an entry, empty
            wanted = None if rows is None else rows[cp_rank].get(i, {}).get(self.module, s.positions[:0])
            keep = cp_routing.select(s.positions, wanted)
            whole = bool(keep.all())
            positions, value = (s.positions, s.value) if whole else (s.positions[keep], s.value[keep])
            sent = _for_wire(value, host)
            out[i] = (positions.to(sent.device), sent, s.total)
            self.acct.sent(value)
        return out

    @_named
    def backward(self, mb: int, *grad_parts: dict[int, torch.Tensor], last: bool = False) -> None:
        """Backward from the gradients of this rank's shards (one object from
        each LLM replica, top-level arguments); ``last``: this rank's last
        backward of the step (gradients may be reduced while it runs)."""
        grads: dict[int, torch.Tensor] = {}
        rows: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for part in grad_parts:
            for i, g in part.items():
                if isinstance(g, tuple):  # some rows of the shard (context parallelism)
                    rows.setdefault(i, []).append(g)
                else:
                    grads[i] = g
        ids, shards = self.pending.pop(mb)
        for i, s in zip(ids, shards):
            if i in rows:
                grads[i] = cp_routing.place_grads(s.positions, s.value, rows[i])
        device = shards[0].value.device if shards else torch.device("cpu")
        missing = [i for i, s in zip(ids, shards) if i not in grads and s.value.numel()]
        if missing:
            raise RuntimeError(f"microbatch {mb}: no gradients came back for samples {missing}")
        if last:
            self.strategy.arm_last_backward()  # type: ignore[union-attr]
        self.strategy.backward(  # type: ignore[union-attr]
            mb,
            [s.value for s in shards],
            [grads[i].to(device) if i in grads else torch.zeros_like(s.value) for i, s in zip(ids, shards)],
        )
        self.acct.freed(mb)

    def drop(self, mb: int) -> None:
        """Forget a microbatch whose gradients will not come (frozen module, eval)."""
        self.pending.pop(mb, None)
        self.acct.freed(mb)
        self.strategy.release(mb)  # type: ignore[union-attr]

    # -- language-model role ------------------------------------------------------------------------
    def _assemble(
        self, sample_ids: list[int], sources: list[tuple[int, str]], parts: tuple[dict, ...]
    ) -> tuple[list[dict[str, torch.Tensor]], dict[int, list]]:
        """Each sample's full embeddings per module, from the shards of every
        source ``(source id, module)`` (``parts``: their objects, in order); and,
        per source id, where its rows went (for :meth:`grads_for`)."""
        device = self.strategy.ctx.device  # type: ignore[union-attr]
        embeds: list[dict[str, torch.Tensor]] = [{} for _ in sample_ids]
        layout: dict[int, list] = {}
        index = {s: k for k, s in enumerate(sample_ids)}
        if len(parts) != len(sources):
            raise RuntimeError(f"{len(parts)} shard objects for {len(sources)} sources")
        for src, part in zip(sources, parts):
            source, module = src[0], src[1]
            # a cached source (None, module, sample): one rank's entry of the feature cache
            items = part.items() if len(src) == 2 else [(src[2], read_part(part))]
            for sid, (positions, value, total) in items:
                e = embeds[index[sid]]
                if module not in e:
                    e[module] = torch.zeros(total, value.shape[-1], dtype=value.dtype, device=device)
                positions = positions.to(device)
                e[module][positions] = value.to(device)
                if source is not None:  # a cached (frozen) source gets no gradient back
                    layout.setdefault(source, []).append((index[sid], sid, module, positions))
        return embeds, layout

    @_named
    def loss_and_backward(
        self,
        mb: int,
        sample_ids: list[int],
        input_refs: list[Any],
        sources: list[tuple[int, str]],
        needs_grad: list[str],
        loss_scale: float,
        *parts: dict[int, tuple[torch.Tensor, torch.Tensor, int]],
        last: bool = False,
    ) -> float:
        """Assemble each sample's embeddings from its sources ``(source id,
        module)`` and their shard objects ``parts`` (top-level arguments), run
        forward and backward; keep the embedding gradients for :meth:`grads_for`."""
        inputs = ray.get(input_refs)
        embeds, layout = self._assemble(sample_ids, sources, parts)
        for e in embeds:
            for module, t in e.items():
                t.requires_grad_(module in needs_grad)
        if last:  # this rank's last backward of the step: gradients may be reduced while it runs
            self.strategy.arm_last_backward()  # type: ignore[union-attr]
        with self._count_saved(mb):
            loss_sum = self.strategy.loss_and_backward(mb, inputs, embeds, loss_scale)  # type: ignore[union-attr]
        self.acct.freed(mb)  # backward has run: nothing stays saved
        self.llm_leaves[mb] = (list(sample_ids), embeds, layout)
        return loss_sum

    @_named
    def grads_for(self, mb: int, source: int, host: bool = True, with_rows: bool = False) -> dict[int, Any]:
        """Gradients of the shards that ``source`` delivered — one object for
        exactly the encoder rank that produced them (in host memory when ``host``);
        ``with_rows``: each as ``(global rows, gradients)``, the part of a shard this
        context-parallel rank got."""
        _, embeds, layout = self.llm_leaves[mb]
        out = {}
        for k, sid, module, positions in layout.get(source, []):
            g = embeds[k][module].grad
            if g is None:
                # The LLM did not use this embedding (no first-party family does this:
                # each consumes every placeholder). Zeros, not "no gradient": the
                # encoder's backward is collective under ulysses/TP, so every rank
                # must run it. The cost is weight decay on an encoder that the
                # single-process model would leave untouched in this step.
                g = torch.zeros_like(embeds[k][module])
            grad = _for_wire(g[positions.to(g.device)], host)
            self.acct.sent(grad)
            out[sid] = (_for_wire(positions, host), grad) if with_rows else grad
        return out

    @_named
    def cp_rows(
        self, sample_ids: list[int], input_refs: list[Any], totals: dict[int, dict[str, int]]
    ) -> RankRows:
        """For each context-parallel rank of this replica, the encoder rows of each sample it
        holds the tokens of (``totals``: sample id -> module -> rows), read from the samples'
        token ids before any row is sent."""
        inputs = ray.get(input_refs)
        n = self.spec.context_parallel
        return cp_routing.rows_per_rank(self.family, sample_ids, inputs, totals, n)

    def release(self, mb: int) -> None:
        self.llm_leaves.pop(mb, None)

    def returns_input_grads(self) -> bool:
        return bool(self.strategy.returns_input_grads())  # type: ignore[union-attr]

    @_named
    def evaluate(
        self,
        sample_ids: list[int],
        input_refs: list[Any],
        sources: list[tuple[int, str]],
        *parts: dict[int, tuple[torch.Tensor, torch.Tensor, int]],
    ) -> tuple[float, int, int]:
        """Forward only: (loss sum, correct argmax predictions, label tokens)."""
        inputs = ray.get(input_refs)
        embeds, _ = self._assemble(sample_ids, sources, parts)
        module = self.strategy.module  # type: ignore[union-attr]
        module.eval()  # no dropout when measuring
        try:
            with torch.no_grad():
                return self.strategy.evaluate(inputs, embeds)  # type: ignore[union-attr]
        finally:
            module.train()

    def end_evaluation(self) -> RankRecord:
        """The record of an evaluation (its time and collectives) and a fresh
        one, so that evaluation between steps counts toward no training step."""
        return self.acct.finish_evaluation(self.strategy.ctx.comm)  # type: ignore[union-attr]

    # -- optimizer step -----------------------------------------------------------------------------
    @_named
    def zero_grad(self) -> None:
        self.strategy.zero_grad()  # type: ignore[union-attr]

    @_named
    def reduce_and_norm(self) -> float:
        """Finish gradient reduction; return the group's squared grad norm."""
        if self.optim is None:
            return 0.0
        self.strategy.reduce_gradients()  # type: ignore[union-attr]
        return self.strategy.grad_norm_sq()  # type: ignore[union-attr]

    @_named
    def step(self, clip_coef: float) -> RankRecord:
        """Optimizer step; return this rank's record of the step and start a new one."""
        lr = self.strategy.current_lr()  # type: ignore[union-attr]  # the rate this step uses
        start = self.acct.timer.start()
        self.strategy.step(clip_coef)  # type: ignore[union-attr]
        return self.acct.finish_step(self.strategy, lr, start)

    def _count_saved(self, mb: int) -> Any:
        return self.acct.count_saved(self.strategy.module, mb)  # type: ignore[union-attr]

    # -- state --------------------------------------------------------------------------------------
    @_named
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        sd = self.strategy.full_state_dict()  # type: ignore[union-attr]
        return sd if self.rank == 0 else None

    @_named
    def full_grads(self) -> dict[str, torch.Tensor] | None:
        g = self.strategy.full_grads()  # type: ignore[union-attr]
        return g if self.rank == 0 else None

    @_named
    def save_full(self, ckpt: str, sharded: bool = False) -> dict[str, dict[str, Any]]:
        """This rank's files of a checkpoint in the full form, or its own pieces
        (``sharded``: ``checkpoint.format: sharded``); collective."""
        from disagg.runtime.actor.state import save_full, save_sharded

        lora = self.optim.lora if self.optim is not None else None
        save = save_sharded if sharded else save_full
        return save(self.strategy, self.rank, Path(ckpt), self.module, lora)  # type: ignore[arg-type]

    @_named
    def load_full(self, ckpt: str, restore_rng: bool) -> None:
        from disagg.runtime.actor.state import load_full

        lora = self.optim.lora if self.optim is not None else None
        load_full(self.strategy, self.rank, Path(ckpt), self.module, restore_rng, lora)  # type: ignore[arg-type]
        self.strategy.refresh_weights()  # type: ignore[union-attr]  # masters a reader filled in place

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
