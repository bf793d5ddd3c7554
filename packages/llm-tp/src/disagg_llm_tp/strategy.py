"""``megatron_tp``: Megatron tensor parallelism inside one module group.

The group's default process group is handed to megatron-core's
``parallel_state`` with ``tensor_model_parallel_size = degree``; Megatron's
contiguous TP groups then coincide with core's layout
``rank = replica * degree + shard`` and its data-parallel groups with
:meth:`GroupContext.replica_peers`.

Gradient bookkeeping (the loss is already divided by the global label count):

- TP-sharded parameters: each rank owns a disjoint piece; summed over replicas.
- TP-replicated parameters (norms, row biases): every TP rank computes the same
  full gradient (Megatron all-reduces activation gradients at the column
  layers), so they are summed over replicas only and counted once in the norm.
- key/value heads replicated for GQA: each copy sees only its own query heads,
  so copies are summed over the ranks that share the head (and replicas).

- with ``sequence_parallel``, replicated parameters used on this rank's tokens
  only (norms, row biases inside a region; ``ShardSpec.sp_partial``) hold partial
  gradients and are summed over the whole group (TP ranks and replicas).

The full form (checkpoints, export) is merged and cut through each tensor's
shard spec by a component, :class:`~disagg_llm_tp.fullstate.TPFullForm` (``self.form``).

The input-embedding gradient is complete on every TP rank for the same reason
(ColumnParallelLinear all-reduces its input gradient; under sequence parallelism
the split's backward all-gathers it), and core collects it from shard 0 of each
replica.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from disagg.interfaces import EmbeddingShard, EncoderFamily, Family, LayerMap, StrategyOptions, dropout_seed
from disagg.interfaces.cost import Cost, CostQuery
from disagg.kit import Strategy, agree_on_grads, context_parallel, sum_of_squares
from disagg.kit.hf import head_split_problems
from disagg.kit.lora import is_adapter_param
from disagg.kit.masters import in_master_view
from disagg.kit.offload import offloaded, offloads_activations
from disagg.kit.recompute import Recompute, tiled_mlp
from disagg.kit.recompute.rng import ShardRNG
from disagg_llm_tp.fullstate import TPFullForm
from disagg_llm_tp.load import load_local
from disagg_llm_tp.module_split import module_splits
from disagg_llm_tp.rng import fork_around, fork_between
from disagg_llm_tp.sequence_parallel import SequenceParallelRegion
from disagg_llm_tp.shard_spec import ShardSpec, TPPlan


class MegatronTPOptions(StrategyOptions):
    sequence_parallel: bool = False
    """Megatron sequence parallelism: the norm/residual/dropout regions between the
    tensor-parallel blocks hold 1/degree of the tokens per rank instead of a replica
    (less activation memory, about the same bytes on the wire). Needs degree >= 2 and a
    family whose layer map declares its regions."""


class MegatronTPStrategy(Strategy):
    """Tensor parallelism with megatron-core layers swapped into the HF module.

    What it changes from the kit's defaults (:class:`disagg.kit.Strategy`, a module every
    rank holds whole):

    - set-up: :meth:`build_module` builds empty (each rank loads its own slices);
      :meth:`parallelize` is the ordered ``apply_*`` steps; LoRA is one of them, on its own
      parallel linears (``lora_step``: core injects no PEFT layers);
    - LLM role: :meth:`token_losses` and :meth:`correct_predictions` over this rank's slice
      of the vocabulary (megatron's vocabulary-parallel cross entropy);
    - encoder role: every TP rank computes the whole output, shard 0 ships it, the
      gradients are broadcast back (:meth:`encode`, :meth:`backward`, :meth:`release`);
    - gradients: :meth:`reduce_gradients` and :meth:`grad_norm_sq` through each parameter's
      :class:`ShardSpec`;
    - state: no method; the full form through the shard specs is a component the kit's state
      adapter calls (``self.form``, a :class:`~disagg_llm_tp.fullstate.TPFullForm`), and the
      adapters' dropout stream is in ``rng_streams`` (the kit saves it);
    - class level: :meth:`check`, :meth:`estimate`, :meth:`option_variants` and the
      capabilities below.

    With ``parallel.llm.context_parallel: N`` (TP x CP): megatron's parallel state is built
    with ``context_parallel_size=N`` on core's layout (TP ranks contiguous, then CP, then
    replicas: megatron's ``tp-cp-ep-dp-pp`` order), the attention all-gathers each TP rank's
    key/value heads over its CP group (:mod:`disagg.kit.context_parallel`), and every
    gradient is summed over CP as over replicas (megatron's data-parallel-with-CP group)."""

    name: ClassVar[str] = "megatron_tp"
    distribution: ClassVar[str] = "disagg-llm-tp"
    options_model: ClassVar[type[StrategyOptions]] = MegatronTPOptions
    # selective would checkpoint Hugging Face's attention function inside the TP
    # attention module; not wired yet, so it is refused at validation
    recompute_modes: ClassVar[tuple[str, ...]] = ("none", "full")
    precisions: ClassVar[tuple[str, ...]] = ("fp32", "bf16", "bf16-pure")
    #: adapters on the column and row linears it splits (lora.py: column/row-parallel adapters)
    lora_support: ClassVar[tuple[str, ...]] = ("column", "row")
    lora_step: ClassVar[bool] = True
    context_parallel_support: ClassVar[bool] = True
    #: the family's MLPs over row tiles; under sequence parallelism each tile gathers its rows and
    #: the down projection's reduce-scatter returns them (the same rows per token)
    mlp_tiles_support: ClassVar[bool] = True

    @classmethod
    def check(cls, family: Family, degree: int, replicas: int, options: StrategyOptions) -> list[str]:
        problems: list[str] = []
        lmap = family.layer_map()
        if lmap is None:
            problems.append(
                f"family {family.name!r} declares no layer map, so strategy 'megatron_tp' cannot split it; "
                "use strategy 'ddp', 'zero' or 'ulysses'"
            )
        for why in lmap.no_split.values() if lmap is not None else ():
            problems.append(
                f"strategy 'megatron_tp' cannot split family {family.name!r} ({family.path}): {why}; "
                "use strategy 'ddp' (optionally with shard: parameters) or 'zero'"
            )
        for spec in lmap.attention.values() if lmap is not None else ():
            # the heads the family declares are what tensor parallelism splits
            for p in head_split_problems(spec.num_heads, spec.num_kv_heads, degree, str(family.path)):
                if p not in problems:  # every layer declares the same counts
                    problems.append(p)
        for split in module_splits(lmap).values() if lmap is not None else ():  # module_split.py
            problems += [p for p in split.problems(degree, str(family.path)) if p not in problems]
        if getattr(options, "sequence_parallel", False):
            if degree < 2:
                problems.append(
                    f"sequence_parallel = true needs degree >= 2 (tokens are split over the TP ranks), "
                    f"but degree is {degree}; set sequence_parallel: false or raise the degree"
                )
            if lmap is not None and lmap.sequence_parallel is None:
                problems.append(
                    f"family {family.name!r} declares no sequence-parallel regions in its layer map, so "
                    "sequence_parallel = true cannot be used with it; allowed: false"
                )
            if tiled_mlp.enabled(getattr(options, "mlp_tiles", 1)) and lmap is not None:
                for pattern, norm in lmap.mlp.items():
                    if not norm:
                        problems.append(
                            f"mlp_tiles with sequence_parallel: family {family.name!r} does not name the "
                            f"norm whose output feeds {pattern} (LayerMap.mlp), which each tile must "
                            "gather instead; allowed: mlp_tiles: 1, or sequence_parallel: false"
                        )
        return problems

    def __init__(self, ctx: Any, family: Family, options: StrategyOptions) -> None:
        super().__init__(ctx, family, options)
        self.plan = TPPlan()
        #: the full form through each tensor's shard spec (fullstate.py): the kit's state
        #: adapter calls it (full_state_dict, full_grads, ..., tensor_layout)
        self.form: TPFullForm = TPFullForm(ctx)
        #: Megatron's layer config and the sequence-parallel region (None without it), for
        #: the layers :meth:`apply_lora` adds after :meth:`apply_tensor_parallel`
        self.mp_config: Any = None
        self.sp: SequenceParallelRegion | None = None
        #: dropout stream of this (replica, TP rank) for head-sharded regions (degree > 1);
        #: the kit's rng_state/set_rng_state save and restore it, and ``rng_streams``' too
        self.rng: ShardRNG | None = None
        self.rng_streams: dict[str, ShardRNG] = {}
        #: microbatch -> every output of the encoder on this TP rank, until its backward
        self._pending: dict[int, list[torch.Tensor]] = {}
        #: microbatch -> the autocast state its forward ran under (see :meth:`backward`)
        self._autocast: dict[int, tuple[bool, torch.dtype]] = {}

    # -- groups ----------------------------------------------------------------------------------------
    def _init_megatron(self) -> None:
        from megatron.core import parallel_state as ps

        d, cp = self.ctx.degree, self.ctx.context_parallel
        if ps.model_parallel_is_initialized() and (
            ps.get_tensor_model_parallel_world_size() != d or ps.get_context_parallel_world_size() != cp
        ):
            ps.destroy_model_parallel()
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=d,
                context_parallel_size=cp,
                create_gloo_process_groups=False,
                # a collective some peer never joins fails after parallel.collective_timeout_s
                distributed_timeout_minutes=self.ctx.collective_timeout.total_seconds() / 60,
            )
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.form.bind(self.tp_group)
        # CP ranks hold partial gradients of the same slices, like replicas: one sum over both
        self.dp_group = ps.get_data_parallel_group(with_context_parallel=True)
        assert dist.get_process_group_ranks(self.tp_group) == self.ctx.shard_ranks(), (
            "megatron TP group != core layout"
        )
        if cp > 1:
            cp_ranks = dist.get_process_group_ranks(ps.get_context_parallel_group())
            assert cp_ranks == self.ctx.cp_peers(), "megatron CP group != core layout"

    def _kv_groups(self) -> dict[int, dist.ProcessGroup]:
        """One group per replicated key/value head: its copies in every replica."""
        if self.plan.kv_replication is None:
            return {}
        kv, share = self.plan.kv_replication
        groups = {}
        for h in range(kv):  # every rank creates every group, in the same order
            ranks = [
                rank
                for r in range(self.ctx.replicas)
                for c in range(self.ctx.context_parallel)
                for rank in self.ctx.shard_ranks(r, c)[h * share : (h + 1) * share]
            ]
            groups[h] = dist.new_group(ranks, timeout=self.ctx.collective_timeout)
        return groups

    # -- parallelize -----------------------------------------------------------------------------------
    def build_module(self) -> nn.Module:
        """Empty (meta device) when the family can build it so: :meth:`parallelize`
        then allocates and reads only this rank's slices; else the whole loaded module."""
        module = self.family.build_empty(torch.float32)
        return self.family.build(torch.float32) if module is None else module

    def parallelize(self, module: nn.Module) -> nn.Module:
        """Ordered steps, as torchtitan's ``parallelize_llama``: tensor (and sequence) parallel
        linears, this rank's slices loaded into a module built empty -> context parallelism ->
        the TP dropout streams -> LoRA on the parallel linears -> recompute (it wraps the
        blocks the steps before rewrote) -> the MLPs in row tiles (inside the blocks, each tile
        checkpointed by the recompute step's streams). No ``shard`` step: the TP split is the
        sharding."""
        lmap = self.family.layer_map()
        if lmap is None:
            raise ValueError(
                f"family {self.family.name!r} has no layer map; strategy 'megatron_tp' cannot split it"
            )
        self.apply_tensor_parallel(module, lmap)
        context_parallel.apply(module, self.ctx, self)
        self.apply_dropout_streams(module, lmap)
        self.apply_lora(module, lmap)
        self.apply_recompute(module)
        self.apply_mlp_tiles(module, lmap)
        return module.to(self.ctx.device)

    def apply_tensor_parallel(self, module: nn.Module, lmap: LayerMap) -> None:
        """megatron-core's column / row / vocabulary layers in place of the layer map's
        linears (:mod:`disagg_llm_tp.parallelize`; ``self.plan`` says what it did); a module
        built empty gets its own slices from the stored tensors."""
        from megatron.core.model_parallel_config import ModelParallelConfig

        from disagg_llm_tp.parallelize import parallelize_module  # megatron-core: see shard_spec.py

        if any(is_adapter_param(n) for n, _ in module.named_parameters()):
            raise ValueError(
                "megatron_tp applies train.modules.<m>.lora itself, to its parallel linears "
                "(lora_step): set the module up without PEFT layers injected"
            )
        self._init_megatron()
        self.mp_config = ModelParallelConfig(
            tensor_model_parallel_size=self.ctx.degree,
            # Layers are built on the CPU and moved: the same code on CPU and CUDA.
            use_cpu_initialization=True,
            perform_initialization=False,
            params_dtype=next(module.parameters()).dtype,
        )
        if self.options.sequence_parallel and self.ctx.degree > 1:
            self.sp = SequenceParallelRegion(self.tp_group, self.ctx.degree, self.ctx.shard, self.ctx.comm)
        empty = any(p.is_meta for p in module.parameters())
        # a tiled MLP gathers its tiles itself: its norm's output stays this rank's rows
        ungathered = frozenset(
            norm
            for _, _, norm in (
                tiled_mlp.mlp_modules(module, lmap) if tiled_mlp.enabled(self.options.mlp_tiles) else ()
            )
        )
        self.plan = parallelize_module(
            module,
            lmap,
            self.ctx.shard,
            self.ctx.degree,
            self.mp_config,
            self.ctx.comm,
            self.sp,
            ungathered if self.sp is not None else frozenset(),
        )
        if empty:
            # megatron's layers hold only this rank's piece: fill them (and the replicated
            # rest) from the stored tensors; nothing has been moved to the device yet
            load_local(module, self.family, self.ctx.shard, self.ctx.degree)
        self.kv_groups = self._kv_groups()

    def apply_dropout_streams(self, module: nn.Module, lmap: LayerMap) -> None:
        """Attention probabilities are a head shard on each TP rank: their dropout draws from
        a stream per (replica, TP rank) (``rng.py``); with adapter dropout, a column adapter's
        input is the replica's, so its masks come from a stream every TP rank of the replica
        shares (``rng_streams["lora_dropout"]``)."""
        if self.ctx.degree == 1:
            return
        ctx = self.ctx
        self.rng = ShardRNG(dropout_seed(ctx.seed, ctx.replica, ctx.shard), ctx.device)
        fork_around(module, [*lmap.heads, *lmap.attention], self.rng)
        fork_between(module, lmap.feature_split, self.rng)
        if self.lora is not None and self.lora.dropout > 0:
            # apart from the default stream; checkpointed with the rank's others (the kit's rng_state)
            self.rng_streams["lora_dropout"] = ShardRNG(
                dropout_seed(ctx.seed, ctx.replica, ctx.degree), ctx.device
            )

    def apply_lora(self, module: nn.Module, lmap: LayerMap) -> None:
        """``train.modules.<m>.lora`` on the parallel linears (``lora.py``): PEFT's draws at
        the full shapes, cut for this rank around each column / row base."""
        if self.lora is None:
            return
        from disagg_llm_tp import lora  # megatron-core's layers: see shard_spec.py

        sites = lora.draw_sites(module, self.lora, self.ctx.module, self.plan, lmap)
        lora.wrap(
            module,
            sites,
            self.ctx.shard,
            self.ctx.degree,
            self.mp_config,
            self.ctx.comm,
            self.sp,
            self.plan.sp_rows if self.sp is not None else set(),
            self.rng_streams.get("lora_dropout"),
            self.rng,
        )

    def apply_recompute(self, module: nn.Module) -> None:
        """A replayed block draws its attention masks from the TP streams again and gathers
        into the shape its forward saw (another microbatch's split may have changed the
        region's since: encoders run ahead)."""
        rngs = [self.rng] if self.rng is not None else []
        self.recompute = Recompute(
            self.options.recompute,
            rngs=rngs + list(self.rng_streams.values()),
            captures=[self.sp.capture_shape] if self.sp is not None else [],
            offload=offloads_activations(self.options),
        )
        self.recompute.apply_full(module, f"family {self.family.name!r} module")

    def apply_mlp_tiles(self, module: nn.Module, lmap: LayerMap) -> None:
        """``parallel.<module>.mlp_tiles`` (:mod:`disagg.kit.recompute.tiled_mlp`). Under sequence
        parallelism an MLP's input is its norm's output on this rank's rows (left ungathered by
        :meth:`apply_tensor_parallel`): each tile gathers its rows from every TP rank (the same
        tile of each rank's rows) and the down projection's reduce-scatter returns this rank's,
        so every token meets the same weights as without tiles."""
        sp = self.sp

        def around(_name: str, _norm: str):  # noqa: ANN202
            if sp is None:
                return None
            return lambda forward: lambda rows, *a, **k: forward(sp.gather_rows(rows), *a, **k)

        gather = sp.degree if sp is not None else 1
        tiled_mlp.apply(module, lmap, self.options.mlp_tiles, self.recompute.tile, around, gather)

    # -- llm role --------------------------------------------------------------------------------------
    def token_losses(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Megatron's vocabulary-parallel cross entropy of each token (0 off the labels), on
        this rank's slice of the vocabulary (of one chunk of tokens: core's chunked loss)."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        masked = self._mask_vocab_padding(logits.float())
        if masked.data_ptr() == logits.data_ptr():
            masked = masked.clone()  # megatron's CE works in place on its input
        keep = labels != -100
        target = torch.where(keep, labels, torch.zeros_like(labels))
        n = self.ctx.degree
        # megatron's cross entropy: three all-reduces (max, sum of exponentials, target logit)
        self.ctx.comm.add("all_reduce", 3 * 2 * (n - 1) * 4 * labels.numel() // n, calls=3)
        losses = vocab_parallel_cross_entropy(masked.unsqueeze(1), target.unsqueeze(1)).squeeze(1)
        return losses * keep

    def correct_predictions(self, logits: torch.Tensor, labels: torch.Tensor) -> int:
        """Argmax over the whole vocabulary from this rank's slice: every TP rank's
        best (value, global id) is gathered and the first rank holding the maximum
        wins, which is torch's first-index rule for ties."""
        start = self.plan.output_range[0]
        local = self._mask_vocab_padding(logits.float())
        best, idx = local.max(-1)
        if self.ctx.degree > 1:
            pair = torch.stack([best.double(), (idx + start).double()])
            stacked = torch.stack(self.form.all_gather(pair))  # [degree, 2, tokens]
            winner = stacked[:, 0].argmax(0)
            idx = stacked[:, 1].gather(0, winner[None])[0].long()
        else:
            idx = idx + start
        mask = labels != -100
        return int((idx[mask] == labels[mask]).sum())

    def _mask_vocab_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """Padding columns of the vocabulary must not win an argmax or enter a softmax."""
        start, end = self.plan.output_range
        pad_from = (self.plan.output_vocab or end) - start
        if pad_from < logits.shape[-1]:
            cols = torch.arange(logits.shape[-1], device=logits.device) >= pad_from
            return logits.masked_fill(cols, torch.finfo(logits.dtype).min)
        return logits

    # -- encoder role ----------------------------------------------------------------------------------
    def encode(self, mb: int, inputs: list[dict[str, torch.Tensor]]) -> list[EmbeddingShard]:
        """Every TP rank computes the whole output; shard 0 alone ships it."""
        assert isinstance(self.family, EncoderFamily) and self.module is not None
        outs = [self.family.encode(self.module, x) for x in inputs]
        self._pending[mb] = outs
        kind = self.ctx.device.type
        self._autocast[mb] = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        if self.ctx.shard == 0:
            return [EmbeddingShard.whole(o) for o in outs]
        return [EmbeddingShard.empty(o.shape[0], o.shape[1], like=o) for o in outs]

    def release(self, mb: int) -> None:
        self._pending.pop(mb, None)
        self._autocast.pop(mb, None)

    def backward(self, mb: int, outputs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Shard 0 received the gradients; its TP peers need them too."""
        src = self.ctx.shard_ranks()[0]
        pending = self._pending.pop(mb, [])
        full = []
        for out, g in zip(pending, grads if self.ctx.shard == 0 else [None] * len(pending)):
            buf = g.to(out.device, out.dtype).contiguous() if g is not None else torch.empty_like(out)
            self.ctx.comm.broadcast(buf, src=src, group=self.tp_group)
            full.append(buf)
        pairs = [(o, g) for o, g in zip(pending, full) if o.requires_grad and o.numel()]
        enabled, dtype = self._autocast.pop(mb, (False, torch.float32))
        # megatron's linear functions restore the forward's autocast state in their
        # backward through torch.amp.custom_bwd for CUDA only; on other devices
        # (CPU bf16) a bf16 output gradient would meet the fp32 weight in a matmul.
        # Core autocasts the forward only, so replay its state here (no cast of our own).
        replay = enabled and self.ctx.device.type != "cuda"
        with torch.autocast(self.ctx.device.type, dtype=dtype, enabled=replay):
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    # -- gradients -------------------------------------------------------------------------------------
    @in_master_view()
    def reduce_gradients(self) -> None:
        """Sum each parameter's gradient over the ranks that hold parts of it.
        Ranks first agree over the module's whole world which parameters got a
        gradient anywhere (a replica without samples has none); one absent
        everywhere keeps ``grad = None`` so AdamW leaves it alone, as in the
        single-process reference."""
        params = self.trainable_parameters()
        buckets: dict[object, list[torch.Tensor]] = {}
        for p, present in zip(params, agree_on_grads(params, self.ctx.comm)):
            if not present:
                continue
            spec: ShardSpec = p.tp_spec
            if spec.kind == "kv_replicated":
                buckets.setdefault(("kv", spec.head), []).append(p.grad)
            elif spec.sp_partial:
                buckets.setdefault("all", []).append(p.grad)
            elif self.ctx.replicas * self.ctx.context_parallel > 1:
                buckets.setdefault("dp", []).append(p.grad)
        groups = {"dp": self.dp_group, "all": None}  # None: the module's own world
        for key, grads in buckets.items():
            group = groups[key] if isinstance(key, str) else self.kv_groups[key[1]]
            if dist.get_world_size(group) == 1:
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.ctx.comm.all_reduce(flat, group=group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    @in_master_view()
    def grad_norm_sq(self) -> float:
        total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        if self.ctx.replica == 0 and self.ctx.cp_rank == 0:  # replicas (and CP ranks) hold the same sums
            params = self.trainable_parameters()
            owned = [p.grad for p in params if p.grad is not None and self._owns(p.tp_spec)]
            total = sum_of_squares(owned).to(self.ctx.device) if owned else total
        self.ctx.comm.all_reduce(total)
        return float(total)

    def _owns(self, spec: ShardSpec) -> bool:
        """Whether this rank counts the parameter's elements in the norm."""
        if spec.kind == "replicated":
            return self.ctx.shard == 0
        if spec.kind == "kv_replicated":
            return self.ctx.shard % spec.kv_share == 0
        return True

    # -- class level -----------------------------------------------------------------------------------
    @classmethod
    def estimate(cls, query: CostQuery, options: StrategyOptions) -> Cost | None:
        """With or without sequence parallelism (:mod:`disagg_llm_tp.cost`)."""
        from disagg_llm_tp import cost

        chunk = getattr(options, "loss_chunk_tokens", cost.DEFAULT_CHUNK_TOKENS)
        offload = offloaded(options)
        tiles = getattr(options, "mlp_tiles", 1)
        return cost.estimate(query, bool(getattr(options, "sequence_parallel", False)), chunk, offload, tiles)

    @classmethod
    def option_variants(cls) -> list[dict]:
        """``disagg plan`` tries sequence parallelism on and off, each also with the optimizer in
        host memory (offered on GPU clusters only)."""
        from disagg_llm_tp import cost

        return [dict(v) for v in cost.OPTION_VARIANTS] + [
            {**v, "offload": "optimizer"} for v in cost.OPTION_VARIANTS
        ]
