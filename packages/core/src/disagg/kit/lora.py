"""LoRA adapters per module (``train.modules.<m>.lora``), built on PEFT.

Core injects PEFT's LoRA layers into the module the strategy's ``build_module``
returned (loaded, partitioned, or empty on the meta device: the adapters are
drawn on the CPU all the same and no base weight is allocated for them), in
the actor, before the strategy parallelizes it: the base weights get
``requires_grad = False`` (no gradient, no optimizer state, no gradient
all-reduce), the adapters and the ``modules_to_save`` parts train. Strategies
see an ordinary module with fewer trainable parameters. A strategy that rewrites the
linears LoRA wraps (``megatron_tp``) sets ``StrategySpec.lora_step``: core then injects
nothing, and the strategy's ``parallelize`` applies ``self.lora`` to its own layers, from
the same draws (:func:`draw_adapters`).

Targets follow PEFT's ``target_modules`` list semantics: a target names a
module by its full dotted name or by a suffix of whole components (``q_proj``,
``attn.qkv``). Which names exist is what the family documents: the linears of
its ``layer_map()`` (column, row and output), checked at validation before any
actor starts, and again on the real module in the actor.

The adapters' initial values are drawn from a generator seeded by
:func:`lora_seed` (``train.seed`` and the module), so every rank of a group and
the single-process reference (the same ``LoraConfig`` on the same HF module,
after ``torch.manual_seed(lora_seed(...))``) start from the same adapters.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from disagg.interfaces.lora import ADAPTER, INSTALL_HINT, LoraSpec, lora_seed


def require_peft() -> Any:
    """The ``peft`` package, or an error that says how to install it."""
    try:
        import peft
    except ImportError as exc:  # optional: only LoRA needs it
        raise ImportError(f"train.modules.<m>.lora needs the peft package: {INSTALL_HINT}") from exc
    return peft


def peft_available() -> bool:
    try:
        require_peft()
    except ImportError:
        return False
    return True


def peft_config(spec: LoraSpec, with_saved: bool = True) -> Any:
    """PEFT's ``LoraConfig`` for ``spec`` (what an exported adapter dir records).
    ``with_saved=False``: without ``modules_to_save``, which PEFT would wrap in a
    trainable copy beside a frozen original; core trains those parts in place
    (the same numbers, half their bytes) and export writes them as PEFT names the copy."""
    peft = require_peft()
    return peft.LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.targets),
        modules_to_save=(list(spec.modules_to_save) or None) if with_saved else None,
        bias="none",
    )


def target_matches(name: str, target: str) -> bool:
    """PEFT's rule for a ``target_modules`` list entry: the whole name or a suffix of components."""
    return name == target or name.endswith("." + target)


def pattern_can_match(pattern: str, target: str) -> bool:
    """Whether some module name matching the ``fnmatch`` ``pattern`` (a layer-map entry,
    e.g. ``model.layers.*.self_attn.q_proj``) is matched by ``target``: the target's
    components equal the pattern's last ones (a ``*`` component stands for any)."""
    t, p = target.split("."), pattern.split(".")
    if len(t) > len(p):
        return False
    return all(fnmatchcase(tc, pc) for tc, pc in zip(t, p[len(p) - len(t) :]))


def documented_linears(layer_map: Any) -> tuple[str, ...]:
    """The linear layers a family documents (its layer map's column, row and output
    patterns, plus ``extra["lora_targets"]`` for linears no strategy splits)."""
    if layer_map is None:
        return ()
    extra = tuple(layer_map.extra.get("lora_targets", ()))
    return tuple(dict.fromkeys((*layer_map.column, *layer_map.row, *layer_map.output, *extra)))


def short_names(patterns: tuple[str, ...]) -> list[str]:
    """The last component of each pattern, for error messages (``q_proj``, ``qkv``)."""
    return sorted({p.rsplit(".", 1)[-1] for p in patterns})


def part_modules(patterns: tuple[str, ...]) -> tuple[str, ...]:
    """Module names of a family part (``merger.*`` -> ``merger``), for PEFT's ``modules_to_save``."""
    out = []
    for p in patterns:
        name = p[:-2] if p.endswith(".*") else p
        if any(c in name for c in "*?["):
            raise ValueError(f"part pattern {p!r} names no single module, so it cannot be a module to save")
        out.append(name)
    return tuple(dict.fromkeys(out))


def is_adapter_param(name: str) -> bool:
    """A LoRA adapter parameter of PEFT's layers (``...lora_A.default.weight``)."""
    return ".lora_A." in name or ".lora_B." in name or ".lora_embedding_" in name


def apply_lora(module: nn.Module, spec: LoraSpec, module_name: str, where: str) -> nn.Module:
    """Inject ``spec``'s adapters into ``module`` in place and freeze the base.

    Every target must wrap at least one layer (an error naming ``where`` and the
    module's linears otherwise); after it only adapters and the parameters of
    ``spec.save_patterns`` require gradients."""
    linears = [n for n, m in module.named_modules() if isinstance(m, nn.Linear)]
    check_targets(spec, linears, where)
    with _real_looking_bases(module):
        module = _seeded_inject(module, spec, module_name)
    freeze_base(module, spec)
    return module


def draw_adapters(
    linears: dict[str, tuple[int, int]], spec: LoraSpec, module_name: str, where: str
) -> nn.Module:
    """The adapters :func:`apply_lora` would inject into a module whose linear layers are
    ``linears`` (name -> full ``(in_features, out_features)``, in the module's order), drawn
    the same way, on a stand-in: a tree of shape-only linears (no base storage) with PEFT's
    layers injected. For a strategy that applies LoRA itself, to linears it rewrote
    (``StrategySpec.lora_step``): it reads each PEFT layer's ``lora_A``/``lora_B``/``scaling``/
    ``lora_dropout`` from the returned tree and cuts them for its own layers."""
    check_targets(spec, list(linears), where)
    root = nn.Module()
    for name, (fan_in, fan_out) in linears.items():
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        lin = nn.Linear(fan_in, fan_out, bias=False, device="meta")
        # zero-storage stand-in: PEFT draws its adapters on the CPU in fp32, as on a loaded module
        lin.weight = nn.Parameter(torch.zeros(()).expand(fan_out, fan_in), requires_grad=False)
        parent.add_module(leaf, lin)
    return _seeded_inject(root, spec, module_name)


def check_targets(spec: LoraSpec, linears: list[str], where: str) -> None:
    """Every target of ``spec`` names at least one of ``linears`` (an error naming ``where`` and
    the linears' last components otherwise)."""
    missing = [t for t in spec.targets if not any(target_matches(n, t) for n in linears)]
    if missing:
        raise ValueError(
            f"{where}.targets: {', '.join(map(repr, missing))} match no linear layer of the module; "
            f"its linears end in: {', '.join(sorted({n.rsplit('.', 1)[-1] for n in linears}))}"
        )


def _seeded_inject(module: nn.Module, spec: LoraSpec, module_name: str) -> nn.Module:
    """PEFT's injection under :func:`lora_seed`, leaving the default RNG stream where it was."""
    peft = require_peft()
    state = torch.random.get_rng_state()
    torch.manual_seed(lora_seed(spec.seed, module_name))
    try:
        return peft.inject_adapter_in_model(peft_config(spec, with_saved=False), module, adapter_name=ADAPTER)
    finally:
        # the adapters' draws must not move the RNG stream that dropout reads later
        torch.random.set_rng_state(state)


@contextmanager
def _real_looking_bases(module: nn.Module) -> Iterator[None]:
    """On a module built empty (meta device, ``Family.build_empty``: the strategy loads its
    own slices later), PEFT would move each new adapter onto its base weight's device, the
    meta device, losing the values it just drew. Each meta linear weight is replaced, for the
    injection only, by a zero-storage CPU stand-in of its shape and dtype (an expanded
    scalar): PEFT then draws and keeps its adapters on the CPU, exactly as on a loaded module
    (the same draws in the same order), and no base weight is ever allocated."""
    swapped = []
    for lin in module.modules():
        w = getattr(lin, "weight", None)
        if isinstance(lin, nn.Linear) and isinstance(w, torch.Tensor) and w.is_meta:
            stand_in = torch.zeros((), dtype=w.dtype).expand(w.shape)
            lin.weight = nn.Parameter(stand_in, requires_grad=False)
            swapped.append((lin, w))
    try:
        yield
    finally:
        # PEFT keeps each wrapped nn.Linear object as its ``base_layer``: restore in place
        for lin, w in swapped:
            lin.weight = w


def freeze_base(module: nn.Module, spec: LoraSpec) -> None:
    """Only adapters and ``spec.save_patterns`` require gradients. By name, so a
    strategy that rebuilt the wrapped linears (names survive parallelization) is
    frozen the same way again."""
    for name, p in module.named_parameters():
        p.requires_grad_(is_adapter_param(name) or any(fnmatchcase(name, s) for s in spec.save_patterns))


def layer_kinds(layer_map: Any) -> dict[str, tuple[str, ...]]:
    """Layer-map kind -> the linear patterns of that kind (``extra`` for ``lora_targets``)."""
    if layer_map is None:
        return {}
    return {
        "column": tuple(layer_map.column),
        "row": tuple(layer_map.row),
        "output": tuple(layer_map.output),
        "extra": tuple(layer_map.extra.get("lora_targets", ())),
    }


def is_trained(name: str, spec: LoraSpec) -> bool:
    """Whether the module's tensor ``name`` trains under ``spec`` (an adapter or a
    ``modules_to_save`` part): what a LoRA checkpoint holds."""
    return is_adapter_param(name) or any(fnmatchcase(name, s) for s in spec.save_patterns)


def adapter_state(state: dict[str, torch.Tensor], spec: LoraSpec) -> dict[str, torch.Tensor]:
    """The trained part of a full state dict: adapters and the ``modules_to_save`` parts."""
    return {k: v for k, v in state.items() if is_trained(k, spec)}
