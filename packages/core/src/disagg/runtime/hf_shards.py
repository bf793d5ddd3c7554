"""Hugging Face sharded safetensors, written tensor by tensor from files on disk.

An export of a 32B model must not hold the model on one process: every tensor
is described by where it lies (:class:`TensorRef`: a safetensors file and key,
read from the file's header only), the refs are split into shards the way
``save_pretrained`` splits a state dict (``huggingface_hub``'s splitter, its
``5GB``-style sizes), and each shard is read, cast and written before the next
is touched. Peak memory is about one shard, not the model.

The layout is Hugging Face's: ``model.safetensors`` when everything fits in one
shard, else ``model-0000k-of-0000n.safetensors`` and
``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"
#: ``--dtype`` values -> what floating-point tensors are written in
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_MAX_SHARD_SIZE = "5GB"  # save_pretrained's and huggingface_hub's default
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorRef:
    """One tensor of a safetensors file, known from the header only."""

    file: Path
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def meta(self) -> torch.Tensor:
        """A stand-in without storage (for families' name mapping)."""
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


@dataclass(frozen=True)
class DcpRef:
    """One full tensor of a sharded checkpoint's ``torch.distributed.checkpoint`` dir,
    known from its metadata only; read (assembled from its pieces by DCP, in this one
    process) when the shard that holds it is written."""

    dir: Path
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def meta(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device="meta")

    def read(self) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        t = torch.empty(self.shape, dtype=self.dtype)
        dcp.load({self.key: t}, checkpoint_id=str(self.dir), no_dist=True)
        return t


def dcp_refs(dcp_dir: Path, prefix: str = "param/") -> dict[str, DcpRef]:
    """The tensors under ``prefix`` of a DCP dir (its metadata only), the prefix stripped."""
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata
    return {
        k[len(prefix) :]: DcpRef(Path(dcp_dir), k, tuple(m.size), m.properties.dtype)
        for k, m in saved.items()
        if k.startswith(prefix)
    }


#: what a shard entry is: a tensor still on disk (a file's, or a sharded checkpoint's),
#: or one a family had to compute
Entry = Union[TensorRef, DcpRef, torch.Tensor]


def tensor_refs(files: list[Path]) -> dict[str, TensorRef]:
    """Every tensor of ``files`` (headers only), in file then header order."""
    out: dict[str, TensorRef] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                sl = fh.get_slice(key)
                kind = sl.get_dtype()
                if kind not in _SAFETENSORS_DTYPES:
                    raise ValueError(f"{f}: tensor {key!r} has dtype {kind}, which export cannot write")
                out[key] = TensorRef(Path(f), key, tuple(sl.get_shape()), _SAFETENSORS_DTYPES[kind])
    return out


def parse_max_shard_size(value: int | str) -> int:
    """Bytes per shard from ``5GB``, ``500MB``, ``100KB`` (powers of ten, as
    ``save_pretrained``) or a plain byte count."""
    from huggingface_hub.serialization._base import parse_size_to_int

    if isinstance(value, int) or str(value).strip().isdigit():
        size = int(value)
    else:
        size = parse_size_to_int(str(value))
    if size <= 0:
        raise ValueError(f"the shard size must be positive, got {value!r}")
    return size


def write_sharded(
    entries: Mapping[str, Entry], dest: Path, dtype: torch.dtype, max_shard_size: int | str
) -> list[str]:
    """Write ``entries`` (output name -> tensor ref or tensor) into ``dest`` as
    HF sharded safetensors, floating-point tensors in ``dtype``; return the
    file names written (index last when sharded). Earlier weight files of an
    export into the same dir are removed first, so no stale shard is loaded."""
    from huggingface_hub import split_state_dict_into_shards_factory

    def nbytes(e: Entry) -> int:
        shape, kind = (e.shape, e.dtype) if isinstance(e, TensorRef) else (tuple(e.shape), e.dtype)
        out = dtype if kind.is_floating_point else kind
        n = 1
        for d in shape:
            n *= d
        return n * out.itemsize

    split = split_state_dict_into_shards_factory(
        dict(entries),
        get_storage_size=nbytes,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=parse_max_shard_size(max_shard_size),
    )
    _remove_old_weights(dest)
    for filename, names in split.filename_to_tensors.items():
        shard = _read(entries, names, dtype)
        save_file(shard, str(dest / filename), metadata={"format": "pt"})
        del shard  # before the next shard is read: one shard in memory at a time
    written = list(split.filename_to_tensors)
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": dict(split.tensor_to_filename)}
        (dest / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(INDEX)
    return written


def set_config_dtype(dest: Path, dtype: torch.dtype) -> None:
    """Make ``config.json`` say the dtype the weights were written in, as
    ``save_pretrained`` does (``from_pretrained`` with ``dtype="auto"`` reads it);
    sub-configs that name a dtype (a VLM's ``text_config``) say it too."""
    path = dest / "config.json"
    if not path.is_file():
        return
    name = str(dtype).removeprefix("torch.")
    cfg = json.loads(path.read_text())

    def fix(d: dict, top: bool) -> None:
        keys = [k for k in ("dtype", "torch_dtype") if k in d]
        for k in keys or (["dtype"] if top else []):
            d[k] = name
        for v in d.values():
            if isinstance(v, dict):
                fix(v, top=False)

    fix(cfg, top=True)
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def _read(entries: Mapping[str, Entry], names: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One shard's tensors. Files are opened per shard and closed after it: a
    handle kept open over the whole export would keep every page it touched
    mapped, and the process's resident memory would grow to the model's size."""
    by_file: dict[Path, list[str]] = {}
    out: dict[str, torch.Tensor] = {}
    for name in names:
        e = entries[name]
        if isinstance(e, TensorRef):
            by_file.setdefault(e.file, []).append(name)
        elif isinstance(e, DcpRef):
            out[name] = _cast(e.read(), dtype)
        else:
            out[name] = _cast(e, dtype)
    for f, group in by_file.items():
        with safe_open(str(f), framework="pt") as fh:
            for name in group:
                out[name] = _cast(fh.get_tensor(entries[name].key), dtype)  # type: ignore[union-attr]
    # the split's order, and no two names sharing storage (tied weights are written once each)
    return {name: out[name] for name in names}


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    t = t.to(dtype) if t.is_floating_point() else t
    return t.contiguous().clone() if t.untyped_storage().nbytes() != t.nbytes else t.contiguous()


def _remove_old_weights(dest: Path) -> None:
    for f in dest.glob("model*.safetensors"):
        if f.name == "model.safetensors" or "-of-" in f.name:
            f.unlink()
    (dest / INDEX).unlink(missing_ok=True)
