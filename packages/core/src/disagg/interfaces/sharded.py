"""``parallel.<module>.shard``: a replicated strategy's state sharded over its group
(``ddp``, ``ulysses``), ZeRO semantics over all ``degree x replicas`` ranks.

- ``optimizer`` (ZeRO-1): torch's ``ZeroRedundancyOptimizer`` around AdamW. Each rank keeps
  the AdamW moments of its partition (whole parameters, balanced by size) and steps them;
  the updated parameters are broadcast from their owners. Parameters and gradients stay
  whole on every rank (gradients summed by the default reduction, norm of whole gradients).
- ``gradients`` (ZeRO-2) and ``parameters`` (ZeRO-3): torch FSDP2, one unit per block
  (:mod:`disagg.interfaces.fsdp`); gradients reduce-scattered (summed) in backward, AdamW
  on the shards, the norm summed over the shards (each element once).

Per rank, with P elements of fp32 state and N ranks: ``none`` 16P; ``optimizer`` 8P + 8P/N
(the moments of its partition); ``gradients`` 4P + 12P/N (the whole parameters are held from
a forward to its backward); ``parameters`` 16P/N plus one block gathered at a time.

FSDP's all-gathers follow the module's forwards, so every rank of the group must run the same
forwards: a rank with fewer samples than another in a microbatch (none included) runs
:func:`placeholder_input` forwards whose output gradient is zero (they add exact zeros). The
group's ranks agree on the count with one small all-reduce (``ddp``); ``ulysses`` runs one
forward per replica and microbatch, so only an empty replica needs one.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from disagg.interfaces import fsdp
from disagg.interfaces.context import GroupContext, OptimSpec
from disagg.interfaces.family import Family
from disagg.interfaces.grads import sum_of_squares
from disagg.interfaces.precision import RECIPES, Recipe
from disagg.interfaces.roles.optimizer import adamw

ShardMode = Literal["none", "optimizer", "gradients", "parameters"]
MODES: tuple[str, ...] = ("none", "optimizer", "gradients", "parameters")
FSDP_MODES: tuple[str, ...] = ("gradients", "parameters")


def module_key(family: Family) -> str:
    if family.role == "llm":
        return "llm"
    return "audio" if getattr(family, "modality", "image") == "audio" else "vision"


def shard_problems(family: Family, options: Any) -> list[str]:
    """What ``parallel.<module>.shard`` cannot do with this family and these options."""
    mode = getattr(options, "shard", "none")
    if mode == "none":
        return []
    key = f"parallel.{module_key(family)}"
    problems = []
    if getattr(options, "overlap_grad_reduce", False):
        problems.append(
            f"{key}.overlap_grad_reduce: true cannot be combined with {key}.shard: {mode} "
            "(the sharded state is reduced by ZeroRedundancyOptimizer/FSDP2 itself); "
            "set overlap_grad_reduce: false, or shard: none"
        )
    if mode in FSDP_MODES and family.role == "llm":
        problems.append(
            f"{key}.shard: {mode} shards encoder state only; allowed for the LLM: none, optimizer "
            "(strategy 'zero' or 'megatron_tp' shard an LLM)"
        )
    elif mode in FSDP_MODES and getattr(family, "modality", "image") != "image":
        problems.append(
            f"{key}.shard: {mode}: a rank without samples runs a placeholder image forward, which "
            f"family {family.name!r} ({family.modality}) has none of; allowed: none, optimizer"
        )
    return problems


def placeholder_input(family: Any, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """One black image, preprocessed by the family (what a rank without samples forwards), its
    pixels in the compute dtype ``dtype`` as the worker casts real inputs."""
    from PIL import Image

    from disagg.interfaces.master_weights import cast_inputs

    return cast_inputs(family.preprocess([Image.new("RGB", (28, 28))]), dtype)


def build_optimizer(
    param_groups: list[dict[str, Any]], optim: OptimSpec, ctx: GroupContext, options: Any = None
) -> torch.optim.Optimizer:
    """AdamW; under ``shard: optimizer`` inside ``ZeroRedundancyOptimizer`` (ZeRO-1)."""
    if getattr(options, "shard", "none") != "optimizer" or ctx.world_size == 1:
        return adamw(param_groups, optim, ctx, options)
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    kernel = {"fused": True} if ctx.device.type == "cuda" else {"foreach": False}
    # its broadcasts on a group of their own (collective: every rank builds it)
    group = dist.new_group(list(range(ctx.world_size)), timeout=ctx.collective_timeout)
    return ZeroRedundancyOptimizer(
        param_groups,
        optimizer_class=torch.optim.AdamW,
        process_group=group,
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        betas=optim.betas,
        eps=optim.eps,
        **kernel,
    )


def _state_bytes(states: Any) -> int:
    return sum(
        fsdp.local(v).numel() * v.element_size() for st in states for v in st.values() if torch.is_tensor(v)
    )


class ShardedReplicas:
    """Mixin before :class:`~disagg.interfaces.Strategy`: ``parallel.<module>.shard`` for a
    strategy whose ranks otherwise hold the whole module (its ``parallelize`` ends with
    :meth:`shard_state`)."""

    build_optimizer = staticmethod(build_optimizer)
    ctx: GroupContext
    options: Any
    module: nn.Module | None
    optimizer: Any
    scheduler: Any
    #: the largest whole-parameter bytes a ``gradients`` forward left gathered (held until backward)
    _whole_bytes: int = 0
    #: the FSDP2 root unit around the module (``gradients``/``parameters``)
    fsdp_root: nn.Module | None = None

    @property
    def shard_mode(self) -> str:
        return getattr(self.options, "shard", "none")

    @property
    def fsdp(self) -> bool:
        return self.shard_mode in FSDP_MODES and self.ctx.world_size > 1

    def shard_state(self, module: nn.Module) -> nn.Module:
        """The end of ``parallelize``: FSDP2 units under ``gradients``/``parameters``."""
        if self.fsdp:
            # FSDP2 applies train.precision itself: its policy casts the fp32 shards (bf16), or
            # the shards are bf16 (bf16-pure)
            self.fsdp_root = fsdp.shard_module(module, self.ctx, self.shard_mode)
            self.precision_applied = True
        return module

    def sharded_call(self, fn: Any, *args: Any) -> Any:
        """``fn(module, *args)`` under the root unit; then what ``gradients`` keeps gathered."""
        assert self.fsdp_root is not None
        out = fsdp.call(self.fsdp_root, fn, *args)
        self.forwarded()
        return out

    def forwarded(self) -> None:
        """After a module call's forward: what ``gradients`` keeps gathered until backward."""
        if self.fsdp and self.shard_mode == "gradients" and self.module is not None:
            self._whole_bytes = max(self._whole_bytes, fsdp.whole_param_bytes(self.module))

    def max_count(self, n: int) -> int:
        """The most forwards any rank of the group runs in this call (one small all-reduce)."""
        counts = torch.zeros(self.ctx.world_size, dtype=torch.int64, device=self.ctx.device)
        counts[self.ctx.rank] = n
        self.ctx.comm.all_reduce(counts)  # a sum of one-hot counts: every rank's count
        return int(counts.max())

    # -- the parallelizer's reduction, norm and step ------------------------------------------------
    def reduce_gradients(self) -> None:
        if self.fsdp:
            return  # FSDP2 reduce-scattered (summed) every block's gradients in backward
        super().reduce_gradients()  # type: ignore[misc]

    def grad_norm_sq(self) -> float:
        if not self.fsdp:
            return super().grad_norm_sq()  # type: ignore[misc]
        assert self.module is not None
        mine = [
            fsdp.local(p.grad) for p in self.module.parameters() if p.requires_grad and p.grad is not None
        ]
        total = sum_of_squares(mine).to(self.ctx.device).reshape(1)
        self.ctx.comm.all_reduce(total)  # every shard once: FSDP's padding is not in to_local()
        return float(total)

    def step(self, clip_coef: float) -> None:
        if not self.fsdp:
            return super().step(clip_coef)  # type: ignore[misc]
        if self.optimizer is None:
            return
        assert self.module is not None
        if clip_coef < 1.0:
            grads = [fsdp.local(p.grad) for p in self.module.parameters() if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, clip_coef)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def state_bytes(self) -> int:
        """Parameters + gradients + optimizer state this rank holds, from the tensors: shards
        under FSDP2 (plus the whole parameters a ``gradients`` step holds from forward to
        backward), this rank's partition of the AdamW state under ZeRO-1."""
        if self.shard_mode == "none" or self.ctx.world_size == 1:
            return super().state_bytes()  # type: ignore[misc]
        assert self.module is not None
        total = 0
        for p in self.module.parameters():
            total += fsdp.local(p).numel() * p.element_size()
            if p.grad is not None:
                total += fsdp.local(p.grad).numel() * p.grad.element_size()
        if self.optimizer is not None:
            states = self.optimizer.optim.state if self.shard_mode == "optimizer" else self.optimizer.state
            total += _state_bytes(states.values())
        return total + self._whole_bytes + self.precision_bytes()  # type: ignore[attr-defined]

    # -- the full form (checkpoints, export, tests) ---------------------------------------------------
    def sharded_state(self, saved: Any = None) -> Any:
        """Sharded checkpoints: whole replicas (``shard: none``) hold every tensor whole (one
        of them writes it); FSDP2 ranks their rows of each parameter and AdamW moment
        (:meth:`tensor_layout`); ZeRO-1 ranks whole parameters and the AdamW state of their
        own partition (the inner optimizer's)."""
        if self.shard_mode == "optimizer" and self.ctx.world_size > 1 and self.optimizer is not None:
            inner = self.optimizer.optim
            owned = {id(p) for g in inner.param_groups for p in g["params"]}
            return self.layout_pieces(saved, optimizer=inner, owned=owned)  # type: ignore[attr-defined]
        return self.layout_pieces(saved)  # type: ignore[attr-defined]

    def tensor_layout(self, param: torch.Tensor) -> Any:
        """A FSDP2 parameter (a ``Shard(0)`` DTensor over the group) and its AdamW moments:
        this rank's rows, ``torch.chunk``'s ``ceil(D / N)`` per rank (FSDP2's split; a rank
        past the end holds none); any other tensor whole."""
        if not fsdp.is_sharded(param):
            return super().tensor_layout(param)  # type: ignore[misc]
        from torch.distributed.tensor import Shard

        full = tuple(param.shape)
        placements, mesh = param.placements, param.device_mesh  # type: ignore[attr-defined]
        if tuple(placements) != (Shard(0),):
            raise ValueError(f"a sharded checkpoint expects FSDP2's Shard(0), got {placements}")
        rows = -(-full[0] // mesh.size())
        start = min(mesh.get_local_rank() * rows, full[0])
        held = fsdp.local(param).shape[0]
        if held != min(full[0], start + rows) - start:
            raise ValueError(f"FSDP2 shard of {held} rows at row {start} of {full}: not torch.chunk's split")
        if held == 0:
            return full, []
        return full, [((start,) + (0,) * (len(full) - 1), ())]

    def local_tensor(self, t: torch.Tensor) -> torch.Tensor:
        return fsdp.local(t)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        if not self.fsdp:
            return super().full_state_dict()  # type: ignore[misc]
        assert self.module is not None
        return {k: fsdp.full(v) for k, v in self.module.state_dict().items()}

    def full_grads(self) -> dict[str, torch.Tensor]:
        if not self.fsdp:
            return super().full_grads()  # type: ignore[misc]
        assert self.module is not None
        return {n: fsdp.full(p.grad) for n, p in self.module.named_parameters() if p.grad is not None}

    def _trainable_order(self) -> list[nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def full_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        if self.shard_mode == "none" or self.optimizer is None or self.ctx.world_size == 1:
            return super().full_optimizer_state()  # type: ignore[misc]
        assert self.module is not None
        names = {id(p): n for n, p in self.module.named_parameters()}
        if self.shard_mode == "optimizer":
            # the library's gather of every partition onto rank 0 (collective)
            self.optimizer.consolidate_state_dict(to=0)
            if self.ctx.rank != 0:
                return {}
            sd = self.optimizer.state_dict()
            order = self._trainable_order()
            return {
                names[id(order[i])]: {
                    k: v.detach().cpu().clone() for k, v in st.items() if torch.is_tensor(v)
                }
                for i, st in sd["state"].items()
            }
        out = {}
        for name, p in self.module.named_parameters():
            st = self.optimizer.state.get(p)
            if st:
                out[name] = {k: fsdp.full(v) for k, v in st.items() if torch.is_tensor(v)}
        return out

    def load_full_state(
        self, params: dict[str, torch.Tensor], optim_state: dict[str, dict[str, torch.Tensor]]
    ) -> None:
        if not self.fsdp:
            super().load_full_state(params, {} if self.shard_mode == "optimizer" else optim_state)  # type: ignore[misc]
            if self.shard_mode == "optimizer" and self.optimizer is not None and self.ctx.world_size > 1:
                self._load_partition(optim_state)
            return
        assert self.module is not None
        with torch.no_grad():
            for name, t in self.module.state_dict(keep_vars=True).items():
                if name not in params:
                    raise KeyError(f"checkpoint has no tensor {name!r} for module {self.ctx.module!r}")
                fsdp.local(t).copy_(fsdp.local(fsdp.like(t, params[name])))
        if self.optimizer is None:
            return
        for name, p in self.module.named_parameters():
            if name in optim_state:
                self.optimizer.state[p] = {
                    k: v.clone() if k == "step" else fsdp.like(p, v) for k, v in optim_state[name].items()
                }

    def _load_partition(self, optim_state: dict[str, dict[str, torch.Tensor]]) -> None:
        """ZeRO-1: the AdamW state of the parameters this rank's partition steps."""
        assert self.module is not None
        owned = {id(p) for g in self.optimizer.optim.param_groups for p in g["params"]}
        for name, p in self.module.named_parameters():
            if id(p) in owned and name in optim_state:
                self.optimizer.optim.state[p] = {
                    k: v.clone() if k == "step" else v.to(p.device, p.dtype).clone()
                    for k, v in optim_state[name].items()
                }


# -- the analytic figure (the cost files' state term) --------------------------------------------------
def zero1_partition(numels: list[int], world: int) -> list[int]:
    """Elements of each rank's ZeRO-1 partition: ``ZeroRedundancyOptimizer``'s greedy rule
    (largest tensor first, to the rank with the fewest elements so far; one param group)."""
    sizes = [0] * world
    for n in sorted(numels, reverse=True):
        r = sizes.index(min(sizes))
        sizes[r] += n
    return sizes


def zero1_tensors(numels: list[int], world: int) -> int:
    """Tensors in the busiest ZeRO-1 partition (each has an AdamW step count)."""
    sizes, count = [0] * world, [0] * world
    for n in sorted(numels, reverse=True):
        r = sizes.index(min(sizes))
        sizes[r] += n
        count[r] += 1
    return count[sizes.index(max(sizes))]


def shard_rows(shape: tuple[int, ...], world: int) -> int:
    """Elements FSDP2's rank 0 (the busiest) holds of a tensor split along dim 0 in
    ``ceil(D / N)``-row chunks."""
    if not shape:
        return 1
    rest = 1
    for s in shape[1:]:
        rest *= s
    return min(shape[0], -(-shape[0] // world)) * rest


def state_bytes(shapes: list[tuple[int, ...]], mode: str, world: int, recipe: Recipe | None = None) -> int:
    """Parameter + gradient + AdamW bytes on the busiest rank of an ``N``-rank group under
    ``parallel.<module>.shard`` (equal to :meth:`ShardedReplicas.state_bytes` measured at a step's
    end in fp32; ``gradients`` adds the whole parameters held from a forward to its backward), in
    ``recipe``'s dtypes (default ``fp32``). ZeRO-1 keeps the weights, gradients and (``bf16``) the
    fp32 masters whole and partitions the moments: torch's ZeroRedundancyOptimizer steps each
    master on its owner and broadcasts it into every rank's whole master. FSDP2 shards what the
    optimizer steps (the master, or the weights without one), the gradients and the moments, and
    ``gradients`` holds the whole weights in the compute dtype."""
    r = recipe or RECIPES["fp32"]
    weight, grad = r.weights.itemsize, r.grads.itemsize
    numels = [_numel(s) for s in shapes]
    whole = sum(numels)
    if mode == "none" or world == 1:
        return r.state_bytes_per_element(True) * whole + 4 * len(shapes)
    if mode == "optimizer":
        part = zero1_partition(numels, world)
        return (
            (weight + grad + r.master_bytes) * whole
            + 2 * r.moments.itemsize * max(part)
            + 4 * zero1_tensors(numels, world)
        )
    local = sum(shard_rows(s, world) for s in shapes)
    sharded_element = (r.master or r.weights).itemsize + grad + 2 * r.moments.itemsize
    held = sharded_element * local + 4 * len(shapes)
    return held + weight * whole if mode == "gradients" else held


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def comm(
    shapes: list[tuple[int, ...]],
    mode: str,
    world: int,
    microbatches: int,
    units: int,
    act_bytes: int,
    grad_bytes: int = 4,
    stepped_bytes: int = 4,
) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes a rank sends per step, and calls, for the state's own collectives (neither seen by
    the collective counter: the library issues them), as :class:`~disagg.interfaces.CommCounter`
    would count them (an all-gather ``(N-1)`` x the rank's shard, a reduce-scatter ``(N-1)/N`` of
    the input). ``optimizer``: the default gradient all-reduce (the caller's) plus each owner's
    broadcast of its partition after the step. FSDP2: per microbatch, one all-gather of every
    unit for the forward and (``parameters``) one more for the backward, in the compute dtype,
    and one reduce-scatter of the whole gradient (``grad_bytes`` per element: fp32 but under
    ``bf16-pure``); ``units``: the FSDP units (blocks + 1)."""
    if world == 1 or mode == "none":
        return {}, {}
    numels = [_numel(s) for s in shapes]
    if mode == "optimizer":
        # the owners broadcast what they stepped (the fp32 master, or bf16-pure's bf16 weights)
        return {"broadcast": stepped_bytes * max(zero1_partition(numels, world))}, {"broadcast": world}
    local = sum(shard_rows(s, world) for s in shapes)
    gathers = (2 if mode == "parameters" else 1) * microbatches
    padded = local * world  # FSDP2 reduce-scatters the padded flat gradient
    return (
        {
            "all_gather": gathers * (world - 1) * local * act_bytes,
            "reduce_scatter": microbatches * (world - 1) * padded * grad_bytes // world,
        },
        {"all_gather": gathers * units, "reduce_scatter": microbatches * units},
    )


def step_comm(
    shapes: list[tuple[int, ...]],
    mode: str,
    w: Any,
    units: int,
    comm_bytes: dict[str, int],
    calls: dict[str, int],
    forwards_per_mb: int = 1,
) -> tuple[dict[str, int], dict[str, int]]:
    """A replicated strategy's communication (``comm_bytes``/``calls``: its gradient all-reduce)
    under ``mode`` for the :class:`~disagg.interfaces.cost.Workload` ``w``: FSDP2 replaces the
    all-reduce; ZeRO-1 adds its broadcasts. ``forwards_per_mb``: module forwards per
    microbatch on the busiest rank (``ddp`` runs one per sample; each gathers and reduces)."""
    extra, extra_calls = comm(
        shapes,
        mode,
        w.world,
        w.microbatches * forwards_per_mb,
        units,
        w.act_bytes,
        getattr(w, "grad_bytes", 4),
    )
    comm_bytes, calls = dict(comm_bytes), dict(calls)
    if mode in FSDP_MODES and w.world > 1:
        comm_bytes.pop("all_reduce", None)
        calls.pop("all_reduce", None)
    for k, v in extra.items():
        comm_bytes[k] = comm_bytes.get(k, 0) + v
    for k, v in extra_calls.items():
        calls[k] = calls.get(k, 0) + v
    return comm_bytes, calls
