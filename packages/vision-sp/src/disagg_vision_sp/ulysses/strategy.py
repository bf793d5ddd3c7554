"""``ulysses``: DeepSpeed-Ulysses sequence parallelism for vision encoders.

Every rank holds the whole encoder. The microbatch of a replica (all images of
all its samples, concatenated in the family's compute order) is cut into
``degree`` contiguous shards on boundaries the family allows; attention that
spans shards goes through all-to-all (see ``attention.py``). Outputs stay
sharded: each rank returns its rows of each sample, tagged with their
positions in the sample, and gets exactly their gradient back.

Gradients: a rank's parameter gradients are sums over its own tokens only
(the all-to-all backward routes q/k/v gradients to the rank that owns the
token), so the base class's single all-reduce over the group (shards and
replicas) gives the single-process gradient, each contribution counted once.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from disagg.interfaces import (
    EmbeddingShard,
    Family,
    ReplicatedOptions,
    StrategyOptions,
    UlyssesFamily,
    dropout_seed,
)
from disagg.kit import Strategy
from disagg.kit.offload import offloaded, offloads_activations
from disagg.kit.recompute import Recompute, tiled_mlp
from disagg.kit.recompute.rng import ShardRNG
from disagg.kit.sharding import shard_problems
from disagg_vision_sp.ulysses import attention
from disagg_vision_sp.ulysses.layout import plan_bounds


class UlyssesStrategy(Strategy):
    name: ClassVar[str] = "ulysses"
    distribution: ClassVar[str] = "disagg-vision-sp"
    recompute_modes: ClassVar[tuple[str, ...]] = ("none", "full", "selective")
    precisions: ClassVar[tuple[str, ...]] = ("fp32", "bf16", "bf16-pure")
    #: every rank holds the whole tower: gradients summed by the default reduction (overlap
    #: optional), or its state sharded over the group (``shard``, disagg.kit.sharding)
    options_model: ClassVar[type[StrategyOptions]] = ReplicatedOptions
    #: a rank's MLPs run on its own sequence shard (attention alone exchanges tokens): tiles of it
    mlp_tiles_support: ClassVar[bool] = True

    @classmethod
    def check(cls, family: Family, degree: int, replicas: int, options: StrategyOptions) -> list[str]:
        if not isinstance(family, UlyssesFamily):
            return [
                f"family {family.name!r} does not support strategy 'ulysses' "
                "(it has no ulysses hook points); "
                "use strategy 'ddp', 'zero' or 'megatron_tp', or a family that implements "
                "disagg.interfaces.UlyssesFamily (qwen2_5_vl, llava; whisper, qwen2_audio with disagg-audio)"
            ]
        problems = list(family.check("ulysses", degree, replicas)) + shard_problems(family, options)
        heads = family.ulysses_heads()
        if heads % degree:
            divisors = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
            module = "audio" if getattr(family, "modality", "image") == "audio" else "vision"
            problems.append(
                f"parallel.{module}.degree={degree}: {heads} attention heads of family {family.name!r} "
                f"are not divisible by it; use a divisor of {heads}: {divisors}"
            )
        return problems

    def __init__(self, ctx: Any, family: Family, options: StrategyOptions) -> None:
        super().__init__(ctx, family, options)
        self.group: dist.ProcessGroup | None = None
        self.base_attention = "sdpa"
        #: dropout stream of this (replica, shard) (degree > 1; see rng.py); the base
        #: rng_state/set_rng_state save it, so a resumed run draws the masks it would have
        self.rng: ShardRNG | None = None
        #: microbatch -> (local output rows, the shard values cut from them), until its backward
        self._pending: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def parallelize(self, module: nn.Module) -> nn.Module:
        """Ordered steps: sequence-parallel attention -> its dropout stream -> recompute ->
        the MLPs in row tiles (``parallel.<module>.mlp_tiles``) -> the sharded state
        (``parallel.<module>.shard``)."""
        self.apply_sequence_parallel(module)
        self.apply_dropout_stream()
        self.apply_recompute(module)
        if tiled_mlp.enabled(self.options.mlp_tiles):  # a family-less module (tests, plugins) never tiles
            tiled_mlp.apply(module, self.family.layer_map(), self.options.mlp_tiles, self.recompute.tile)
        return self.shard_state(module)

    def apply_sequence_parallel(self, module: nn.Module) -> None:
        """Ulysses' all-to-all attention in every attention module the family names, over
        this replica's ranks."""
        assert isinstance(self.family, UlyssesFamily)
        attention.register()
        for sub in self.family.ulysses_attention_modules(module):
            impl = sub.config._attn_implementation
            if impl != attention.ATTN_NAME:
                self.base_attention = impl or "sdpa"
                sub.config._attn_implementation = attention.ATTN_NAME
        self.group = self._replica_group()

    def apply_dropout_stream(self) -> None:
        """Every activation of a ulysses forward differs across the ranks of a replica (own
        tokens outside the all-to-all, a head shard inside), so the forward draws dropout from
        a per-shard stream. Masks cannot equal the single-process encoder's: HF draws one
        mask over all heads and tokens from one stream."""
        if self.ctx.degree > 1:
            ctx = self.ctx
            self.rng = ShardRNG(dropout_seed(ctx.seed, ctx.replica, ctx.shard), ctx.device)

    def apply_recompute(self, module: nn.Module) -> None:
        """A replayed block draws its masks from the shard stream again and runs inside the
        runtime (and spanning scope) its forward saw."""
        self.recompute = Recompute(
            self.options.recompute,
            rngs=[self.rng] if self.rng else [],
            captures=[_capture_runtime],
            offload=offloads_activations(self.options),
        )
        self.recompute.apply_full(module, f"family {self.family.name!r} tower")

    def _replica_group(self) -> dist.ProcessGroup | None:
        ctx = self.ctx
        if ctx.degree == 1:
            return None
        if ctx.replicas == 1:
            return dist.group.WORLD
        # new_group is collective over the whole world: every rank creates every replica's group.
        groups = [
            dist.new_group(ctx.shard_ranks(r), timeout=ctx.collective_timeout) for r in range(ctx.replicas)
        ]
        return groups[ctx.replica]

    # -- encoder role -----------------------------------------------------------------------------
    def encode(self, mb: int, inputs: list[dict[str, torch.Tensor]]) -> list[EmbeddingShard]:
        fam = self.family
        assert isinstance(fam, UlyssesFamily) and self.module is not None
        placeholder = not inputs
        if placeholder and not (self.fsdp and self.ctx.replicas > 1):
            return []  # a replica without images this microbatch: its ranks all skip together
        # FSDP2 gathers over every replica, and every replica makes one forward per microbatch
        # (its samples concatenated): an empty one forwards a placeholder image (zero gradient
        # in backward), so its ranks issue the same all-gathers as the others
        inputs = self.lockstep.pad(inputs, 1)
        layout = fam.ulysses_layout(inputs)
        bounds = plan_bounds(layout.cuts, layout.n_tokens, self.ctx.degree)
        if any(b % layout.unit for b in bounds):
            raise ValueError(
                f"family {fam.name!r} allowed cuts {bounds} that split its {layout.unit}-token units"
            )
        lo, hi = bounds[self.ctx.shard], bounds[self.ctx.shard + 1]
        runtime = attention.UlyssesRuntime(
            base=self.base_attention,
            group=self.group,
            degree=self.ctx.degree,
            shard=self.ctx.shard,
            sizes=[b - a for a, b in zip(bounds, bounds[1:])],
            comm=self.ctx.comm,
            recompute=self.recompute,
        )
        forked = self.rng.fork() if self.rng is not None else contextlib.nullcontext()
        with runtime.active(), forked:
            if self.fsdp:  # the root unit (patch embedding, merger) gathered around the whole call
                rows = self.sharded_call(fam.ulysses_forward, inputs, layout, lo, hi, runtime)
            else:
                rows = fam.ulysses_forward(self.module, inputs, layout, lo, hi, runtime)
        if placeholder:
            self.lockstep.keep(mb, [rows])
            return []
        shards, picks = self._split(rows, layout, lo // layout.unit, hi // layout.unit)
        if rows.requires_grad:
            self._pending[mb] = (rows, picks)
        return shards

    @staticmethod
    def _split(
        rows: torch.Tensor, layout: Any, r0: int, r1: int
    ) -> tuple[list[EmbeddingShard], list[slice | torch.Tensor]]:
        """One shard per sample, and which local rows it took. A sample's rows
        are contiguous (samples are concatenated in compute order) unless the
        family drops some (``row_sample`` -1, e.g. CLIP's CLS rows), which no
        shard takes."""
        owner = layout.row_sample[r0:r1]
        shards, picks = [], []
        for s, total in enumerate(layout.sample_rows):
            idx = torch.nonzero(owner == s).flatten()
            if idx.numel() == 0:
                shards.append(EmbeddingShard.empty(total, rows.shape[-1], like=rows))
                picks.append(slice(0, 0))
                continue
            a, b = int(idx[0]), int(idx[-1]) + 1
            pick: slice | torch.Tensor = slice(a, b) if b - a == idx.numel() else idx
            shards.append(EmbeddingShard(layout.row_pos[r0 + idx].clone(), rows[pick], total))
            picks.append(pick)
        return shards, picks

    def release(self, mb: int) -> None:
        self._pending.pop(mb, None)
        super().release(mb)  # an empty replica's placeholder forward (disagg.kit.lockstep)

    def backward(self, mb: int, outputs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Backward of one encoded microbatch. Runs even when this rank's rows
        are empty: the all-to-all backward needs every rank of the replica."""
        seeds = self.lockstep.zero_seeds(mb)
        if seeds:  # an empty replica's placeholder forward: its zero-gradient backward
            if grads:
                raise ValueError(f"{len(grads)} gradients for the empty microbatch {mb}")
            torch.autograd.backward([o for o, _ in seeds], [g for _, g in seeds])
            return
        if mb not in self._pending:
            return
        rows, picks = self._pending.pop(mb)
        if len(grads) != len(picks):
            raise ValueError(f"{len(grads)} gradients for the {len(picks)} samples of microbatch {mb}")
        # Rows no shard took (dropped by the family) get a zero gradient: the LLM never saw them.
        grad = torch.zeros_like(rows)
        for pick, g in zip(picks, grads):
            grad[pick] = g.to(rows.device, rows.dtype).reshape(grad[pick].shape)
        torch.autograd.backward(rows, grad)

    @classmethod
    def estimate(cls, query: Any, options: StrategyOptions) -> Any:
        """Exact bytes for encoder towers (:mod:`disagg_vision_sp.ulysses.cost`); nothing for decoders."""
        from disagg_vision_sp.ulysses import cost

        return cost.estimate(
            query,
            getattr(options, "shard", "none"),
            offloaded(options),
            getattr(options, "overlap_grad_reduce", False),
            getattr(options, "mlp_tiles", 1),
        )

    @classmethod
    def option_variants(cls) -> list[dict[str, Any]]:
        """``disagg plan`` tries the whole tower on every rank and each sharded state, each also
        with the optimizer in host memory (offered on GPU clusters only)."""
        states = [{}, {"shard": "optimizer"}, {"shard": "gradients"}, {"shard": "parameters"}]
        return states + [{**v, "offload": "optimizer"} for v in states]


def _capture_runtime() -> Any:
    """At a checkpointed block's forward: the runtime and its spanning segments, to
    be active again around the block's replay."""
    rt = attention.current()
    if rt is None:
        return contextlib.nullcontext
    segments = None if rt.segments is None else list(rt.segments)
    return lambda: rt.restored(segments)
