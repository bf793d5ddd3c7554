"""What DeepSpeed needs around it inside a group: environment, errors, norms, gathering."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from disagg.interfaces import GroupContext


def prepare(ctx: GroupContext) -> ModuleType:
    """Import DeepSpeed for this rank's device and attach it to the group's
    existing default process group (the user sets nothing by hand)."""
    accelerator = "cpu" if ctx.device.type == "cpu" else "cuda"
    # DeepSpeed picks its accelerator once, at first use; it must match ours.
    os.environ.setdefault("DS_ACCELERATOR", accelerator)
    if not dist.is_initialized():
        raise RuntimeError(
            "strategy 'zero' needs the group's torch.distributed process group to be initialized first"
        )
    # The engine reads these (ranks for logging, LOCAL_RANK for the device).
    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    os.environ.setdefault("LOCAL_RANK", str(ctx.device.index or 0))
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    got = get_accelerator().device_name()
    if got != accelerator:
        raise RuntimeError(
            f"DeepSpeed chose accelerator {got!r} but group {ctx.module!r} runs on {ctx.device}; "
            f"set DS_ACCELERATOR={accelerator} before deepspeed is first imported in this process"
        )
    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False, verbose=False)
    return deepspeed


@contextlib.contextmanager
def config_errors(where: str) -> Iterator[None]:
    """Re-raise DeepSpeed's rejection of a config with the disagg key it came from."""
    from pydantic import ValidationError

    try:
        yield
    except ValidationError as exc:
        lines = [
            f"{where}.ds_config.{'.'.join(str(p) for p in e['loc'])}: {e['msg']} (got {e.get('input')!r})"
            for e in exc.errors()
        ]
        raise ValueError("DeepSpeed rejected the config:\n  " + "\n  ".join(lines)) from exc
    except (ValueError, AssertionError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{where} (strategy 'zero', ds_config): DeepSpeed rejected the config: {exc}"
        ) from exc


def global_grad_norm(ds_optimizer: Any, stage: int) -> float:
    """The group's gradient L2 norm from DeepSpeed's reduced, partitioned fp32
    gradients: each element once (its owner rank), summed over the group, so
    identical on every rank. Non-finite norms come back as ``inf``."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.utils import combine_grad_norm_groups, get_global_norm_of_tensors

    if stage == 3:
        norm = combine_grad_norm_groups(ds_optimizer._get_norm_groups())  # noqa: SLF001
    elif isinstance(ds_optimizer, BF16_Optimizer):
        # stage 1 under train.precision bf16: every rank holds the whole all-reduced fp32
        # gradient, so its local norm is the group's (what BF16_Optimizer.step computes)
        norm = get_global_norm_of_tensors(ds_optimizer.get_grads_for_norm()[0], mpu=None)
    else:
        norm = ds_optimizer.scaled_global_norm()
    # loss_scale is 1 in fp32/bf16; divide anyway so fp16 configs stay right.
    return float(norm) / float(getattr(ds_optimizer, "loss_scale", 1.0) or 1.0)


@contextlib.contextmanager
def gathered(module: nn.Module, stage: int, has_engine: bool) -> Iterator[None]:
    """Full parameters inside the block (ZeRO-3: one all-gather of every
    parameter of ``module``, in module order; collective)."""
    if stage < 3 or not has_engine:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        yield


def master_seeds(params: list[nn.Parameter], stage: int) -> list[torch.Tensor | None]:
    """Per trainable parameter, the fp32 values its master should start from before DeepSpeed
    casts the module to bf16: stages 1-2 the whole fp32 tensor (held until
    :func:`seed_masters`), stage 3 this rank's fp32 partition that :mod:`disagg_zero.build`
    kept while loading (None where there is none: a parameter built in bf16 already)."""
    if stage < 3:
        return [p.data if p.dtype == torch.float32 else None for p in params]
    return [getattr(p, "fp32_partition", None) for p in params]


def seed_masters(
    ds_optimizer: Any, params: list[nn.Parameter], stage: int, seeds: list[torch.Tensor | None]
) -> None:
    """Overwrite DeepSpeed's fp32 master fragments, which it made from the bf16 weights, with
    the loaded fp32 values (:func:`master_seeds`); local copies, no collective."""
    from deepspeed.utils import safe_set_full_fp32_param

    with torch.no_grad():
        for p, seed in zip(params, seeds):
            if seed is None:
                continue
            if stage < 3:
                safe_set_full_fp32_param(p, seed)
                continue
            group, offset, numel = ds_optimizer.grad_position[ds_optimizer.get_param_id(p)]
            frag = ds_optimizer.fp32_partitioned_groups_flat[group].narrow(0, offset, numel)
            frag.copy_(seed[:numel].to(frag.dtype))
            del p.fp32_partition


def master_partitions(ds_optimizer: Any) -> list[torch.Tensor]:
    """Stages 1-2: this rank's flat master partitions, one per param group (DeepSpeed's ZeRO
    optimizer's, or ``BF16_Optimizer``'s under stage 1 and ``train.precision: bf16``)."""
    flats = getattr(ds_optimizer, "single_partition_of_fp32_groups", None)
    return list(flats if flats is not None else ds_optimizer.fp32_groups_flat_partition)


def full_masters(params: list[nn.Parameter]) -> dict[int, torch.Tensor]:
    """Each parameter's whole fp32 master (DeepSpeed's partitions, gathered: a collective per
    parameter, in ``params``' order), on the CPU, by ``id`` of the parameter."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for p in params:
        shape = p.ds_shape if hasattr(p, "ds_shape") else p.shape
        out[id(p)] = safe_get_full_fp32_param(p).detach().float().cpu().view(shape).clone()
    return out


def held_bytes(module: nn.Module, ds_optimizer: Any, optimizer: Any) -> int:
    """Bytes of every distinct storage this rank holds for training: the
    module's parameters (whole, or ZeRO-3's persistent ones), their ZeRO-3
    partitions and gradients, DeepSpeed's flat buffers, fp32 master copies and
    gradient partitions (the tensor attributes of its optimizer, and those in
    lists and dicts up to two levels deep), and the torch optimizer's state. Storages shared by
    views count once; meta tensors hold nothing."""
    seen: set[int] = set()
    total = 0

    def add(t: Any, depth: int = 0) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor):
            if t.is_meta:
                return
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        elif isinstance(t, (list, tuple)) and depth < 3:
            for x in t:
                add(x, depth + 1)
        elif isinstance(t, dict) and depth < 3:
            for x in t.values():
                add(x, depth + 1)

    for p in module.parameters():
        add([p.data, getattr(p, "ds_tensor", None), p.grad])
    if ds_optimizer is not None:
        add(list(vars(ds_optimizer).values()))
    if optimizer is not None:
        add(list(optimizer.state.values()))
    return total


def param_offload(engine: Any) -> Any:
    """ZeRO-3's parameter coordinator owner (``DeepSpeedZeRoOffload``) of ``engine``."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    opt = engine.optimizer
    return opt if isinstance(opt, DeepSpeedZeRoOffload) else opt.parameter_offload


@contextlib.contextmanager
def without_zero3_hooks(engine: Any, module: nn.Module) -> Iterator[None]:
    """``module``'s own calls inside the block skip DeepSpeed's ZeRO-3 hooks (no gather, no
    backward bookkeeping); other hooks still run. For the deferred output head of the chunked
    loss, whose call returns its input and uses no parameter: DeepSpeed would gather the head
    for nothing, and, the head being called again per chunk, its per-module backward counter
    (reset by each call) would then keep the head gathered for the rest of the backward."""
    offload = param_offload(engine)
    ours = {h.id for h in offload.forward_hooks + offload.backward_hooks}
    dicts = [module._forward_pre_hooks, module._forward_hooks]  # noqa: SLF001
    saved = [dict(d) for d in dicts]
    for d in dicts:
        for key in [k for k in d if k in ours]:
            del d[key]
    try:
        yield
    finally:
        for d, full in zip(dicts, saved):
            d.clear()
            d.update(full)


def keep_replayed(engine: Any) -> None:
    """A recomputed region's replay (in backward) fetches each submodule through DeepSpeed's
    pre-forward hook as a forward does, but does not release it after: its backward, next,
    uses the same parameters and releases them (post-backward hook).

    DeepSpeed's post-forward release would free parameters the backward already fetched
    (a set of active submodule ids, not a count: the replay's forward of a module whose
    backward fetched it first, e.g. the loss chunk's head or a layer's last linear, removes
    the backward's hold), and their gradients would then land on an empty parameter. What the
    replay gathers is held anyway: the replay saves the gathered weights for the backward
    (torch's checkpoint keeps them until they are used), so releasing early frees nothing and
    costs a second gather in the backward. Frozen parameters DeepSpeed itself ties to the
    backward's module (``ds_recompute_parameters``), released with it."""
    from disagg.kit.recompute import replaying

    offload = param_offload(engine)
    release = offload.post_sub_module_forward_function

    def post_forward(sub_module: nn.Module) -> None:
        if not replaying():
            release(sub_module)

    offload.post_sub_module_forward_function = post_forward


class GatherProbe:
    """The most bytes of partitioned (non-persistent) ZeRO-3 parameters held whole at once,
    sampled after each of DeepSpeed's per-submodule fetches (forward and backward), where the
    gathered set is largest: the current submodule's parameters, the prefetched ones and those
    kept for reuse. Measurement only (it scans the parameters at every fetch)."""

    def __init__(self, engine: Any, module: nn.Module) -> None:
        self.params = [p for p in module.parameters() if hasattr(p, "ds_tensor") and not p.ds_persist]
        self.peak = 0
        self.fetches = 0
        coordinator = param_offload(engine).get_param_coordinator()
        fetch = coordinator.fetch_sub_module

        def probed(sub_module: nn.Module, forward: bool) -> None:
            fetch(sub_module, forward=forward)
            self.fetches += 1
            self.peak = max(self.peak, self.held())

        coordinator.fetch_sub_module = probed

    def held(self) -> int:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        return sum(
            p.ds_numel * p.element_size() for p in self.params if p.ds_status != ZeroParamStatus.NOT_AVAILABLE
        )


def local_fragments(
    ds_optimizer: Any, params: list[nn.Parameter], stage: int
) -> list[tuple[int, int, int, int]]:
    """Where each parameter's fp32 master fragment on this rank lies inside the
    flat partitions DeepSpeed's wrapped optimizer steps: (storage pointer,
    storage offset, element count, index into ``params``). Padding elements of
    a partition belong to no parameter."""
    out = []
    for i, p in enumerate(params):
        if stage == 3:
            group, offset, numel = ds_optimizer.grad_position[ds_optimizer.get_param_id(p)]
            frag = ds_optimizer.fp32_partitioned_groups_flat[group].narrow(0, offset, numel)
        else:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:  # no element of this parameter in this rank's partition
                continue
            frag = mapping.hp_fragment
        if frag.numel():
            out.append((frag.untyped_storage().data_ptr(), frag.storage_offset(), frag.numel(), i))
    return out
