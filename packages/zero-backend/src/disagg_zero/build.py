"""ZeRO-3's build: the module is constructed partitioned and each rank reads only
its own slice of every weight, so no rank ever holds the whole module.

This is how Hugging Face and DeepSpeed build a ZeRO-3 model (``HfDeepSpeedConfig``
alive while ``from_pretrained`` runs: construction under ``deepspeed.zero.Init``,
which partitions each submodule's parameters as soon as its ``__init__`` returns),
with one change to the load that follows. Hugging Face reads the whole state dict
on rank 0 and, module by module, gathers the parameters on every rank for rank 0
to fill and broadcast; that holds the whole checkpoint on rank 0. Here every rank
sees only the tensor names and shapes (meta tensors) and copies its own flat
partition of each parameter (``param.ds_tensor``, DeepSpeed's contiguous
``ceil(numel / n)`` elements at ``rank * ceil(numel / n)``) straight from the
safetensors file with ``get_slice``: the rows that cover its range, nothing more,
no collective. Buffers are read whole (they are not partitioned).

Checkpoints whose tensors ``from_pretrained`` converts on load (a non-empty
``weight_mapping``: fused or renamed expert weights) take Hugging Face's own path
instead, as does a ``.bin`` checkpoint; :data:`LAST_LOAD` says which path ran.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

#: how the last build on this process loaded its weights: "slices" or "huggingface"
LAST_LOAD: dict[str, Any] = {}


def build_partitioned(build: Callable[[], nn.Module], ds_config: dict[str, Any]) -> nn.Module:
    """``build()`` (a family's ``from_pretrained``) with ZeRO-3 partitioned construction
    and this rank's slices loaded (module docstring). Collective only inside DeepSpeed's
    ``zero.Init`` bookkeeping (every rank builds)."""
    from transformers.integrations import deepspeed as hf_ds

    files: dict[str, str] = {}
    holder = hf_ds.HfDeepSpeedConfig(ds_config)  # noqa: F841 - transformers keeps a weak reference
    try:
        with _sliced_loading(files), _no_init_broadcast():
            return build()
    finally:
        hf_ds.unset_hf_deepspeed_config()


@contextlib.contextmanager
def _no_init_broadcast() -> Iterator[None]:
    """``zero.Init`` broadcasts every parameter from rank 0 as it is constructed, so that
    random initialisations agree; every loaded tensor is overwritten from the file, and
    Hugging Face initialises the ones the file lacks under ``GatheredParameters`` with
    ``modifier_rank=0`` (rank 0's values broadcast), so the broadcast only costs a
    whole-tensor collective and its receive buffers per parameter."""
    from deepspeed.runtime.zero.partition_parameters import Init

    original = Init._zero_init_param  # noqa: SLF001

    def partition_only(self: Any, param: nn.Parameter) -> None:
        self._convert_to_deepspeed_param(param)  # noqa: SLF001
        param.partition()

    Init._zero_init_param = partition_only  # noqa: SLF001
    try:
        yield
    finally:
        Init._zero_init_param = original  # noqa: SLF001


@contextlib.contextmanager
def _sliced_loading(files: dict[str, str]) -> Iterator[None]:
    """Make ``from_pretrained``'s ZeRO-3 load read meta tensors (remembering the file
    of each key) and fill partitions with :func:`load_partitions`."""
    from transformers import modeling_utils as mu

    read, fill = mu.load_state_dict, mu._load_state_dict_into_zero3_model  # noqa: SLF001

    def meta_read(checkpoint_file: Any, map_location: Any = "cpu", **kw: Any) -> dict[str, torch.Tensor]:
        path = str(checkpoint_file)
        if not path.endswith(".safetensors"):
            return read(checkpoint_file, map_location=map_location, **kw)
        out = read(checkpoint_file, map_location="meta", **kw)
        files.update(dict.fromkeys(out, path))
        return out

    def sliced_fill(model: nn.Module, state_dict: dict[str, torch.Tensor], load_config: Any = None) -> Any:
        wanted = renamed_keys(model, state_dict, getattr(load_config, "weight_mapping", None) or [])
        if wanted is None or not all(k in files for k in wanted.values()):
            LAST_LOAD["path"] = "huggingface"
            real = {k: _read_whole(files[k], k) if k in files else v for k, v in state_dict.items()}
            return fill(model, real, load_config)
        LAST_LOAD["path"] = "slices"
        return load_partitions(model, wanted, files)

    mu.load_state_dict, mu._load_state_dict_into_zero3_model = meta_read, sliced_fill  # noqa: SLF001
    try:
        yield
    finally:
        mu.load_state_dict, mu._load_state_dict_into_zero3_model = read, fill  # noqa: SLF001


def _read_whole(path: str, key: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return f.get_tensor(key)


def renamed_keys(
    model: nn.Module, state_dict: dict[str, torch.Tensor], mapping: list[Any]
) -> dict[str, str] | None:
    """Model state-dict name -> checkpoint key, by Hugging Face's own renaming for its
    ZeRO-3 load (``base_model_prefix``, legacy and registered renames); ``None`` when a
    conversion makes new tensors (fused or split weights), which no slice maps to."""
    from transformers.core_model_loading import WeightConverter
    from transformers.integrations.deepspeed import _apply_weight_conversions_to_state_dict

    if any(isinstance(m, WeightConverter) for m in mapping):
        return None
    origin = {id(v): k for k, v in state_dict.items()}
    out: dict[str, str] = {}
    result = _apply_weight_conversions_to_state_dict(model, dict(state_dict), mapping)
    # one dict up to transformers 5.17 (the GPU host's); a generator of dicts, one per
    # conversion, from the release after (5.25 here)
    for converted in [result] if isinstance(result, dict) else result:
        for name, v in converted.items():
            if id(v) not in origin:
                return None
            out[name] = origin[id(v)]
    return out


def load_partitions(
    model: nn.Module, wanted: dict[str, str], files: dict[str, str]
) -> tuple[list[str], set[str]]:
    """Copy this rank's partition of every parameter (and every buffer whole) named in
    ``wanted`` (model name -> checkpoint key) from ``files`` (checkpoint key -> file);
    returns ``(error messages, missing keys)`` as Hugging Face's loader does."""
    from safetensors import safe_open

    missing = set(model.state_dict().keys()) - set(wanted)
    errors: list[str] = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in wanted:
                continue
            key = wanted[name]
            # one mapping per tensor: the pages read stay resident while the file is mapped
            with safe_open(files[key], framework="pt") as f:
                errors += _fill_partition(p, f.get_slice(key), name)
            p._is_hf_initialized = True  # noqa: SLF001 - transformers skips initialising it
        for name, b in model.named_buffers():
            if name in wanted and b is not None:
                key = wanted[name]
                b.copy_(_read_whole(files[key], key).to(b.device, b.dtype))
                b._is_hf_initialized = True  # noqa: SLF001
    LAST_LOAD["read_elements"] = sum(getattr(p, "ds_tensor", p).numel() for p in model.parameters())
    return errors, missing


def _fill_partition(p: nn.Parameter, src: Any, name: str) -> list[str]:
    """``p``'s flat partition on this rank from a safetensors slice, reading only the
    leading-dimension rows that cover it; DeepSpeed's padding past the end stays zero."""
    shape = tuple(src.get_shape())
    full = tuple(getattr(p, "ds_shape", p.shape))
    if shape != full:
        return [f"size mismatch for {name}: checkpoint {shape}, model {full}"]
    part = getattr(p, "ds_tensor", None)
    if part is None:  # not a ZeRO-3 parameter (e.g. built outside zero.Init): the whole tensor
        p.data.copy_(src[:].to(p.dtype).view(p.shape))
        return []
    numel = 1
    for d in shape:
        numel *= d
    start = min(part.numel() * _rank(p), numel)
    stop = min(start + part.numel(), numel)
    part.data.zero_()
    if stop <= start:
        return []
    if len(shape) == 0:
        piece = src[()].reshape(-1)
    else:
        row = numel // shape[0] if shape[0] else 1
        r0, r1 = start // row, -(-stop // row)
        piece = src[r0:r1].reshape(-1)[start - r0 * row : stop - r0 * row]
    part.data[: stop - start].copy_(piece.to(part.dtype))
    if part.dtype != piece.dtype and piece.dtype == torch.float32:
        # train.precision bf16: the partition is bf16; the fp32 master DeepSpeed makes from it
        # starts from these values instead (runtime.seed_masters, which drops them)
        fp32 = torch.zeros(part.numel(), dtype=torch.float32, device=part.device)
        fp32[: stop - start].copy_(piece)
        p.fp32_partition = fp32
    return []


def _rank(p: nn.Parameter) -> int:
    """This rank's index in ``p``'s partition group."""
    import torch.distributed as dist

    return dist.get_rank(group=p.ds_process_group)
