"""LoRA adapters on megatron_tp's column- and row-parallel linears: the strategy's LoRA step,
after tensor parallelism (``StrategySpec.lora_step``: core injects no PEFT layers first).

The adapters' values are PEFT's own draws (:func:`disagg.kit.lora.draw_adapters`): PEFT
injects them, under the module's LoRA seed, into a stand-in of the module's linears at their
full shapes (:attr:`TPPlan.linears <disagg_llm_tp.parallelize.TPPlan.linears>` for those tensor
parallelism replaced), exactly the values it would draw on the single-process HF model. Each
adapter is then cut for this rank around its parallel base, the split of PEFT's
``LoraParallelLinear`` for megatron-core:

- column-parallel base (output split): ``lora_A`` replicated (a full
  ``[r, in]`` on every TP rank), ``lora_B`` column-parallel, cut like the
  base's output rows (the same :class:`ShardSpec`: fused ``qkv`` blocks,
  replicated key/value heads);
- row-parallel base (input split): ``lora_A`` row-parallel, cut like the
  base's input columns, ``lora_B`` replicated.

Which code is ours and why: PEFT's ``LoraParallelLinear`` builds megatron's
own ``ColumnParallelLinear``/``RowParallelLinear`` from a megatron-core
``TransformerConfig`` and expects megatron's ``(output, bias)`` calling
convention and its base layer classes; ours are the thin HF-convention
subclasses of :mod:`disagg_llm_tp.layers` (counted collectives, sequence
parallelism without megatron's CUDA-only reduce-scatter, ``tp_spec`` on every
parameter for exact reduction, norms and merges). So the wrapper here is ours
(about the size of PEFT's), the adapters' layers are those same megatron-core
subclasses, and the parameter names stay PEFT's (``base_layer``,
``lora_A.default``, ``lora_B.default``), so checkpoints, exports and the
single-process PEFT model name every tensor alike.

Gradients: the column adapter's ``lora_B`` all-reduces its input gradient
(megatron's ColumnParallelLinear backward), so ``lora_A``'s gradient is whole
on every TP rank; under sequence parallelism that sum happens once, in the
gather's reduce-scatter, so ``lora_A`` holds part of its gradient
(``sp_partial``). The row adapter's ``lora_A`` all-reduces (or
reduce-scatters) its output, so ``lora_B`` sees the whole (or this rank's
tokens of the) hidden adapter activation.

Dropout on the adapter's input: a column adapter's input is the same on every
TP rank of a replica, so its mask comes from one stream per replica (every TP
rank draws the same); a row adapter's input is a feature shard, so its mask
comes from the TP rank's own stream (as attention dropout does, :mod:`.rng`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch
from torch import nn

from disagg.interfaces import LayerMap
from disagg.interfaces.lora import ADAPTER, LoraSpec
from disagg.kit.lora import draw_adapters
from disagg.kit.recompute.rng import ShardRNG
from disagg_llm_tp.layers import TPColumnLinear, TPRowLinear
from disagg_llm_tp.module_split import module_splits, under
from disagg_llm_tp.shard_spec import ShardSpec, TPPlan, copy_into, mark


@dataclass
class Site:
    """One adapter as PEFT drew it, at its linear's full shape."""

    name: str
    kind: str  # "column" or "row"
    a: torch.Tensor  # full [r, in]
    b: torch.Tensor  # full [out, r]
    scaling: float
    dropout: float


def _set_child(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


def draw_sites(
    module: nn.Module, spec: LoraSpec, module_name: str, plan: TPPlan, lmap: LayerMap
) -> list[Site]:
    """PEFT's adapters for ``spec`` on ``module`` after tensor parallelism: drawn at the full
    shapes of its linears (``plan.linears`` for the parallel ones), in the module's order, as on
    the unpartitioned module. One on a linear the layer map does not split is an error
    (validation refuses such targets first)."""
    from peft.tuners.lora import Linear as LoraLinear

    linears = {
        n: plan.linears.get(n) or (m.in_features, m.out_features)
        for n, m in module.named_modules()
        if n in plan.linears or isinstance(m, nn.Linear)
    }
    drawn = draw_adapters(linears, spec, module_name, f"train.modules.{module_name}.lora")
    owned = under(module_splits(lmap))
    sites = []
    for name, mod in drawn.named_modules():
        if not isinstance(mod, LoraLinear):
            continue
        if any(fnmatchcase(name, p) for p in lmap.column):
            kind = "column"
        elif any(fnmatchcase(name, p) for p in lmap.row):
            kind = "row"
        else:
            raise ValueError(
                f"megatron_tp: LoRA wraps {name!r}, which the layer map does not split as a column or "
                "row linear; target only column/row linears under megatron_tp"
            )
        if any(fnmatchcase(name, p) for p in owned):
            # a family-supplied split (e.g. qwen3_5's gated delta net: in_proj_qkv's q, k and v
            # blocks cut by heads separately) does not cut like a plain column / row linear, and
            # adapters on it were never compared with PEFT: refused rather than cut wrongly
            raise ValueError(
                f"megatron_tp: LoRA on {name!r} is not supported: family {module_name!r} splits it "
                "by its own rule (LayerMap.extra); leave it out of train.modules.<m>.lora.targets "
                "or use strategy ddp/zero for this module"
            )
        drop = mod.lora_dropout[ADAPTER]
        sites.append(
            Site(
                name,
                kind,
                mod.lora_A[ADAPTER].weight.detach(),
                mod.lora_B[ADAPTER].weight.detach(),
                float(mod.scaling[ADAPTER]),
                float(drop.p) if isinstance(drop, nn.Dropout) else 0.0,
            )
        )
    return sites


class TPLoraLinear(nn.Module):
    """``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling`` over a TP base layer,
    with PEFT's attribute names (so parameter names are PEFT's)."""

    def __init__(
        self,
        base: nn.Module,
        a: nn.Module,
        b: nn.Module,
        scaling: float,
        dropout: float,
        rng: ShardRNG | None,
    ) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({ADAPTER: a})
        self.lora_B = nn.ModuleDict({ADAPTER: b})
        self.lora_dropout = nn.ModuleDict({ADAPTER: nn.Dropout(dropout) if dropout > 0 else nn.Identity()})
        self.scaling = {ADAPTER: scaling}
        #: the stream the adapter's dropout draws from (None: the current one)
        self.rng = rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        with self.rng.fork() if self.rng is not None else contextlib.nullcontext():
            h = self.lora_dropout[ADAPTER](x)
        delta = self.lora_B[ADAPTER](self.lora_A[ADAPTER](h))
        return out + delta * self.scaling[ADAPTER]


def wrap(
    module: nn.Module,
    sites: list[Site],
    shard: int,
    degree: int,
    config: object,
    comm: object,
    sp: object | None,
    sp_rows: set[str],
    replica_rng: ShardRNG | None,
    shard_rng: ShardRNG | None,
) -> list[str]:
    """Wrap each site's parallel base layer in a :class:`TPLoraLinear` with its adapters cut for
    this rank; ``sp_rows``: row linears inside a sequence-parallel region (their adapter
    reduce-scatters too). Returns the names."""
    done = []
    for s in sites:
        base = module.get_submodule(s.name)
        r, (out_f, in_f) = s.a.shape[0], (s.b.shape[0], s.a.shape[1])
        spec: ShardSpec = base.weight.tp_spec  # type: ignore[assignment]
        if s.kind == "column":
            a: nn.Module = nn.Linear(in_f, r, bias=False)
            # the base's output rows (kv_replicated: head_dim per rank of degree x head_dim)
            b_out = base.weight.shape[0] * degree
            b: nn.Module = TPColumnLinear(r, b_out, False, config, comm, sp)  # type: ignore[arg-type]
            mark(a.weight, ShardSpec("replicated", sp_partial=sp is not None))
            mark(b.weight, spec)
            rng = replica_rng
        else:
            region = sp if s.name in sp_rows else None
            a = TPRowLinear(in_f, r, False, config, comm, region)  # type: ignore[arg-type]
            b = nn.Linear(r, out_f, bias=False)
            mark(a.weight, ShardSpec("row"))
            mark(b.weight, ShardSpec("replicated", sp_partial=region is not None))
            rng = shard_rng
        copy_into(a.weight, s.a, shard, degree)
        copy_into(b.weight, s.b, shard, degree)
        new = TPLoraLinear(base, a, b, s.scaling, s.dropout, rng if s.dropout > 0 else None)
        _set_child(module, s.name, new)
        done.append(s.name)
    return done
