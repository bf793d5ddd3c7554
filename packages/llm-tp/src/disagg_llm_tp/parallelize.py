"""Rewrite an unpartitioned Hugging Face module for one tensor-parallel rank.

Driven only by the family's :class:`~disagg.interfaces.LayerMap`:

- ``vocab`` embeddings -> :class:`TPVocabEmbedding` over the vocabulary padded
  to a multiple of the degree; ``output`` linears -> column-parallel over the
  same padded vocabulary (tied to the embedding when HF ties them);
- ``column`` / ``row`` linears -> megatron Column/RowParallelLinear;
- ``heads`` attributes are divided by the degree;
- ``attention`` (:class:`~disagg.interfaces.AttentionSpec` per pattern) with
  ``num_kv_heads`` declares grouped-query attention: key/value heads are split
  when ``num_kv_heads`` is divisible by the degree, otherwise each rank keeps a
  copy of the one key/value head its query heads use (``kv_replicated``; needs
  ``degree % num_kv_heads == 0``); its head counts are what the strategy's
  check holds the degree to;
- ``column_chunks`` (``{pattern: n}``) marks fused projections (a vision
  ``qkv`` is 3 blocks) whose blocks are each split separately;
- ``sequence_parallel`` (:class:`~disagg.interfaces.SequenceParallelRegions`)
  declares the sequence-parallel regions: modules whose ``hidden_states``
  input enters a region, norms whose output leaves it (every column/output
  linear must read such an output), and the row linears whose output re-enters
  it (every row linear inside a region);
- ``replicated`` (fnmatch patterns over parameter names) declares the
  parameters every TP rank holds in full (norms, patch/position embeddings).
  The biases of row linears are replicated by construction;
- ``head_replicated`` (patterns) declares full copies that each TP rank
  applies to its own attention heads only (Qwen3's per-head q/k norms): each
  rank then holds part of their gradient, summed over the TP ranks;
- ``extra[module_split.SPLITS]`` (``{pattern: ModuleSplit}``) hands whole
  modules to a family-supplied split (a gated-delta-net layer,
  :mod:`disagg_llm_tp.module_split`).

Every parameter leaves with a ``tp_spec`` (:class:`ShardSpec`); one that no
declaration names is an error naming it, never a silent replica.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from megatron.core.model_parallel_config import ModelParallelConfig
from torch import nn

from disagg.interfaces import LayerMap
from disagg.interfaces.comm import CommCounter
from disagg_llm_tp.layers import TPColumnLinear, TPRowLinear, TPVocabEmbedding
from disagg_llm_tp.module_split import SplitContext, module_splits, under
from disagg_llm_tp.sequence_parallel import SequenceParallelRegion
from disagg_llm_tp.shard_spec import ShardSpec, TPPlan, copy_into, mark, padded_size


def _match(name: str, patterns: tuple[str, ...] | list[str]) -> bool:
    return any(fnmatchcase(name, p) for p in patterns)


def _lookup(name: str, table: dict) -> object | None:
    for pat, val in table.items():
        if fnmatchcase(name, pat):
            return val
    return None


def _set_child(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)


def parallelize_module(
    module: nn.Module,
    lmap: LayerMap,
    shard: int,
    degree: int,
    config: ModelParallelConfig,
    comm: CommCounter,
    sp: SequenceParallelRegion | None = None,
    ungathered: frozenset[str] = frozenset(),
) -> TPPlan:
    """``ungathered``: norms whose output stays this rank's rows under sequence parallelism (the
    MLPs they feed gather it per tile, :mod:`disagg.kit.recompute.tiled_mlp`)."""
    undeclared = unclassified_parameters(module, lmap)
    if undeclared:
        raise ValueError(
            f"megatron_tp: the family's layer map does not classify parameter(s) {', '.join(undeclared)}; "
            "name each one's module as a column/row/vocab/output linear or, when every TP rank holds "
            "the same full copy (norms, patch or position embeddings), declare it in "
            "LayerMap.replicated (fnmatch patterns over parameter names)"
        )
    plan = TPPlan()
    sp_rows = _wire_sequence_parallel(module, lmap, sp, ungathered) if sp is not None else set()
    plan.sp_rows = sp_rows
    # only grouped-query declarations change how key/value projections are cut
    attention = {pat: spec for pat, spec in lmap.attention.items() if spec.num_kv_heads is not None}
    chunks = dict(lmap.column_chunks)
    named = dict(module.named_modules())
    tied: dict[int, nn.Parameter] = {}
    splits = module_splits(lmap)
    split_owned = under(splits)

    # Embeddings first so that an output layer tied to one can share its new weight.
    for name, mod in named.items():
        if not name or not _match(name, lmap.vocab):
            continue
        if not isinstance(mod, nn.Embedding):
            raise TypeError(
                f"layer map vocab pattern matched {name!r}, a {type(mod).__name__}, not nn.Embedding"
            )
        vocab, hidden = mod.weight.shape
        new = TPVocabEmbedding(padded_size(vocab, degree), hidden, mod.padding_idx, config, comm)
        mark(new.weight, ShardSpec("vocab", full_rows=vocab))
        copy_into(new.weight, mod.weight, shard, degree)
        new.weight.requires_grad_(mod.weight.requires_grad)
        tied[id(mod.weight)] = new.weight
        _set_child(module, name, new)
        plan.swapped.append(name)

    for name, mod in named.items():
        if not name or name in plan.swapped:
            continue
        if isinstance(mod, nn.Linear) and _match(name, (*lmap.output, *lmap.column, *lmap.row)):
            plan.linears[name] = (mod.in_features, mod.out_features)
        if _match(name, split_owned):
            continue  # cut by its family-supplied split (below)
        if _match(name, lmap.output):
            _swap_output(module, name, mod, shard, degree, config, comm, tied, plan, sp)
        elif _match(name, lmap.column):
            _swap_column(module, name, mod, shard, degree, config, comm, attention, chunks, plan, sp)
        elif _match(name, lmap.row):
            _check_linear(name, mod, "row")
            region = sp if name in sp_rows else None
            new = TPRowLinear(mod.in_features, mod.out_features, mod.bias is not None, config, comm, region)
            mark(new.weight, ShardSpec("row"))
            copy_into(new.weight, mod.weight, shard, degree)
            if mod.bias is not None:
                # Added after the all-reduce (or reduce-scatter): the same full bias on
                # every rank, applied to all tokens (or, under sequence parallelism, to
                # this rank's tokens, so its gradient is partial).
                mark(new.bias, ShardSpec("replicated", sp_partial=region is not None))
                copy_into(new.bias, mod.bias, shard, degree)
            _set_child(module, name, new)
            plan.swapped.append(name)

    for name, mod in named.items():  # family-supplied splits (module_split.py)
        split = _lookup(name, splits) if name else None
        if split is not None:
            split.split(name, mod, SplitContext(shard, degree, config, comm, sp, sp_rows))  # type: ignore[attr-defined]
            plan.swapped.append(name)

    for name, mod in module.named_modules():
        attrs = _lookup(name, lmap.heads) if name else None
        for attr in attrs or ():
            value = getattr(mod, attr)
            if value % degree:
                raise ValueError(
                    f"{name}.{attr} = {value} is not divisible by tensor-parallel degree {degree}"
                )
            setattr(mod, attr, value // degree)
        spec = _lookup(name, attention) if name else None
        if spec is not None:
            q_local = spec.num_heads // degree
            kv = spec.kv_heads
            kv_local = kv // degree if kv % degree == 0 else 1
            setattr(mod, spec.groups_attr, q_local // kv_local)
            if spec.kv_heads_attr and hasattr(mod, spec.kv_heads_attr):
                setattr(mod, spec.kv_heads_attr, kv_local)

    per_head = lmap.head_replicated
    for name, p in module.named_parameters():
        if not hasattr(p, "tp_spec"):
            if _match(name, per_head):
                mark(p, ShardSpec("replicated", sp_partial=True))  # used on this rank's heads only
                continue
            assert _match(name, lmap.replicated), name  # checked above
            mark(p, ShardSpec("replicated"))
    return plan


def unclassified_parameters(module: nn.Module, lmap: LayerMap) -> list[str]:
    """Parameters of the unpartitioned ``module`` that ``lmap`` does not
    classify: neither in a column/row/vocab/output linear nor declared
    replicated. Run as is, one would be a full copy on every TP rank, silently
    wrong if it acts on a sharded activation (a new family's extra projection,
    say), so every one must be declared."""
    swapped = (*lmap.column, *lmap.row, *lmap.vocab, *lmap.output)
    replicated = (*lmap.replicated, *lmap.head_replicated, *under(module_splits(lmap)))
    return [
        name
        for name, _ in module.named_parameters()
        if not _match(name.rpartition(".")[0], swapped) and not _match(name, replicated)
    ]


def _check_linear(name: str, mod: nn.Module, kind: str) -> None:
    if not isinstance(mod, nn.Linear):
        raise TypeError(f"layer map {kind} pattern matched {name!r}, a {type(mod).__name__}, not nn.Linear")


def _swap_output(module, name, mod, shard, degree, config, comm, tied, plan, sp) -> None:
    _check_linear(name, mod, "output")
    vocab = mod.out_features
    padded = padded_size(vocab, degree)
    new = TPColumnLinear(mod.in_features, padded, mod.bias is not None, config, comm, sp)
    if id(mod.weight) in tied:
        # Tied input/output embeddings: one parameter, cut the same way in both.
        del new.weight
        new.weight = tied[id(mod.weight)]
    else:
        mark(new.weight, ShardSpec("vocab", full_rows=vocab))
        copy_into(new.weight, mod.weight, shard, degree)
        new.weight.requires_grad_(mod.weight.requires_grad)
    if mod.bias is not None:
        mark(new.bias, ShardSpec("vocab", full_rows=vocab))
        copy_into(new.bias, mod.bias, shard, degree)
    per = padded // degree
    plan.output_vocab = vocab
    plan.output_range = (shard * per, (shard + 1) * per)
    _set_child(module, name, new)
    plan.swapped.append(name)


def _swap_column(module, name, mod, shard, degree, config, comm, attention, chunks, plan, sp) -> None:
    _check_linear(name, mod, "column")
    parent, _, child = name.rpartition(".")
    attn = _lookup(parent, attention) if parent else None
    if attn is not None and child in (attn.k, attn.v) and attn.kv_heads % degree:
        kv = attn.kv_heads
        if degree % kv:
            raise ValueError(f"{kv} key/value heads cannot be split or replicated over degree {degree}")
        head_dim = mod.out_features // kv
        share = degree // kv
        # Megatron sees a column layer of degree*head_dim outputs, head_dim per rank;
        # its weight is the full key/value head this rank's query heads attend with.
        new = TPColumnLinear(mod.in_features, head_dim * degree, mod.bias is not None, config, comm, sp)
        spec = ShardSpec("kv_replicated", head=shard // share, kv_share=share, num_heads=kv)
        plan.kv_replication = (kv, share)
    else:
        n = int(_lookup(name, chunks) or 1)
        if mod.out_features % (n * degree):
            raise ValueError(
                f"{name} has {mod.out_features} output features, not divisible by {n} x degree {degree}"
            )
        new = TPColumnLinear(mod.in_features, mod.out_features, mod.bias is not None, config, comm, sp)
        spec = ShardSpec("column", chunks=n)
    mark(new.weight, spec)
    copy_into(new.weight, mod.weight, shard, degree)
    if mod.bias is not None:
        mark(new.bias, spec)
        copy_into(new.bias, mod.bias, shard, degree)
    _set_child(module, name, new)
    plan.swapped.append(name)


def _wire_sequence_parallel(
    module: nn.Module, lmap: LayerMap, sp: SequenceParallelRegion, ungathered: frozenset[str] = frozenset()
) -> set[str]:
    """Hook the region transitions into the HF module; returns the names of the
    row linears whose output re-enters a region. A norm in ``ungathered`` keeps its
    output in the region (its tiled MLP gathers each tile itself)."""
    decl = lmap.sequence_parallel
    if decl is None:
        raise ValueError("the family's layer map declares no sequence-parallel regions")
    named = dict(module.named_modules())
    found: dict[str, list[str]] = {}
    for key in ("split", "gather", "reduce_scatter"):
        patterns = getattr(decl, key)
        found[key] = [n for n in named if n and _match(n, patterns)]
        if not found[key]:
            raise ValueError(f"sequence_parallel {key} patterns {patterns} match no module")

    def split(_mod, args, kwargs):
        if args:
            return (sp.split(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": sp.split(kwargs["hidden_states"])}

    def gather(_mod, _args, output):
        return sp.gather(output)

    for name in found["split"]:
        named[name].register_forward_pre_hook(split, with_kwargs=True)
    missing = sorted(set(ungathered) - set(found["gather"]))
    if missing:
        raise ValueError(
            f"mlp_tiles: the norm(s) {', '.join(missing)} feeding a tiled MLP are not sequence-parallel "
            f"gather points of the family's layer map ({decl.gather})"
        )
    for name in found["gather"]:
        if name not in ungathered:
            named[name].register_forward_hook(gather)
        for p in named[name].parameters(recurse=True):
            mark(p, ShardSpec("replicated", sp_partial=True))  # a norm on this rank's tokens only
    # Rows outside every region (e.g. a vision merger's) keep their all-reduce.
    return set(found["reduce_scatter"])
