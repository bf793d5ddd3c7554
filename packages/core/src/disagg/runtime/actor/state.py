"""One rank's part of a checkpoint, in the layout-free full form.

Rank 0 of a group writes the module's merged parameters
(``<module>/full.safetensors``), merged optimizer state
(``<module>/optim.safetensors``, keys ``<parameter>::<state>``) and its
scheduler and optimizer hyper-parameters (``<module>/schedule.json``); every
rank writes its random streams (``<module>/rng/rank-K.safetensors``). No
pickle anywhere: tensors in safetensors, the rest in JSON.

Every file is fsynced and checksummed by the rank that wrote it; the driver
puts the checksums in the manifest and renames the checkpoint dir only then.

Sharded (:func:`save_sharded`): instead of the two merged files, the group's
ranks write ``<module>/dcp/`` with ``torch.distributed.checkpoint`` (the
module's own process group is its world): ``__K_0.distcp`` holds the pieces
rank K was picked to write (about 1/d of the group's parameters and optimizer
state), ``.metadata`` (rank 0) where every piece lies in the full tensors.
:func:`load_full` takes either form; from a sharded one each rank reads only
the stored regions that overlap its own pieces. A LoRA module's checkpoint
(either form) holds only its trained tensors (adapters, ``modules_to_save``
parts) and their optimizer state; the frozen base is read from the model dir. Resuming
one, each rank reads only its own pieces of those tensors, from either form (a full form's
through safetensors slices), unless its strategy states no layout.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from disagg.interfaces.lora import LoraSpec
from disagg.kit import Strategy
from disagg.kit.checkpoint import load_pieces, save_pieces
from disagg.kit.lora import adapter_state, is_trained
from disagg.kit.roles.state import Pieces

SEP = "::"


def save_full(
    strategy: Strategy, rank: int, ckpt: Path, module: str, lora: LoraSpec | None = None
) -> dict[str, dict[str, Any]]:
    """Write this rank's files under ``ckpt/module``; return ``{relative path:
    {"sha256", "bytes"}}``. Collective (the strategy merges). With ``lora`` only
    the adapters and the ``modules_to_save`` parts are written: the frozen base
    is the model dir's, unchanged."""
    params = strategy.full_state_dict()
    if lora is not None:
        params = adapter_state(params, lora)
    optim = strategy.full_optimizer_state()
    root = Path(ckpt) / module
    (root / "rng").mkdir(parents=True, exist_ok=True)
    written = []
    if rank == 0:
        save_file(_contiguous(params), str(root / "full.safetensors"), metadata={"format": "pt"})
        flat = {f"{name}{SEP}{k}": v for name, st in optim.items() for k, v in st.items()}
        save_file(_contiguous(flat), str(root / "optim.safetensors"), metadata={"format": "pt"})
        (root / "schedule.json").write_text(json.dumps(schedule_state(strategy), indent=1))
        written += [root / "full.safetensors", root / "optim.safetensors", root / "schedule.json"]
    tensors, meta = rng_state(strategy)
    rng_file = root / "rng" / f"rank-{rank}.safetensors"
    save_file(tensors, str(rng_file), metadata={"state": json.dumps(meta)})
    written.append(rng_file)
    return {str(f.relative_to(ckpt)): file_digest(f, sync=True) for f in written}


def save_sharded(
    strategy: Strategy, rank: int, ckpt: Path, module: str, lora: LoraSpec | None = None
) -> dict[str, dict[str, Any]]:
    """Write this rank's pieces of the module's state under ``ckpt/module/dcp`` (with
    the schedule and random streams as :func:`save_full` does); a strategy that states
    no layout (``sharded_state`` is None) writes the full form instead. With ``lora``
    only the trained tensors' pieces (adapters, ``modules_to_save`` parts) and their
    optimizer state are written: the frozen base is the model dir's. Collective."""
    pieces = strategy.sharded_state()
    if pieces is None:
        return save_full(strategy, rank, ckpt, module, lora)
    if lora is not None:
        pieces = trained_pieces(pieces, lora)
    root = Path(ckpt) / module
    (root / "rng").mkdir(parents=True, exist_ok=True)
    save_pieces(pieces, root / "dcp")
    written = sorted((root / "dcp").glob(f"__{rank}_*.distcp"))
    if rank == 0:
        (root / "schedule.json").write_text(json.dumps(schedule_state(strategy), indent=1))
        written += [root / "dcp" / ".metadata", root / "schedule.json"]
    tensors, meta = rng_state(strategy)
    rng_file = root / "rng" / f"rank-{rank}.safetensors"
    save_file(tensors, str(rng_file), metadata={"state": json.dumps(meta)})
    written.append(rng_file)
    return {str(f.relative_to(ckpt)): file_digest(f, sync=True) for f in written}


def trained_pieces(pieces: Pieces, lora: LoraSpec) -> Pieces:
    """A LoRA module's pieces that a checkpoint holds: the trained parameters and every
    optimizer state (only trained parameters have any), never the frozen base."""
    return {k: v for k, v in pieces.items() if not k.startswith("param/") or is_trained(k[6:], lora)}


def _load_sharded(strategy: Strategy, root: Path, lora: LoraSpec | None) -> int:
    """Returns the tensor bytes this rank read."""
    import torch.distributed.checkpoint as dcp

    def pieces_for(saved: Any) -> Pieces | None:
        pieces = strategy.sharded_state(saved)
        # a LoRA module's base stays as the model dir built it
        return trained_pieces(pieces, lora) if pieces is not None and lora is not None else pieces

    read = load_pieces(pieces_for, root / "dcp", str(root))
    if read is not None:
        return read
    reader = dcp.FileSystemReader(str(root / "dcp"))
    saved = reader.read_metadata().state_dict_metadata
    # a strategy without a stated layout slices the full form itself: every tensor whole
    full = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in saved.items()}
    dcp.load(full, storage_reader=reader)
    params, optim = _split(full)
    read = sum(t.numel() * t.element_size() for t in full.values())
    if lora is not None:  # the checkpoint holds the trained tensors only: the base, merged
        base = strategy.full_state_dict()
        read += sum(t.numel() * t.element_size() for k, t in base.items() if k not in params)
        params = {**base, **params}
    strategy.load_full_state(params, optim)
    return read


#: safetensors' dtype names (a slice's ``get_dtype``)
_DTYPES = {
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


def _load_trained(strategy: Strategy, root: Path, lora: LoraSpec) -> int | None:
    """A LoRA module's full-form checkpoint (its trained tensors only) into this rank's own
    pieces of them, by the layout the strategy states, as a sharded resume fills them: each
    rank reads only the regions it holds (safetensors slices), and the frozen base stays as
    the model dir built it, never merged or gathered. Returns the tensor bytes read, or
    ``None`` when the strategy states no layout (it takes the full form whole)."""
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    with contextlib.ExitStack() as files:
        stored: dict[str, tuple[Any, str]] = {}
        params = files.enter_context(safe_open(str(root / "full.safetensors"), framework="pt"))
        stored.update({f"param/{k}": (params, k) for k in params.keys()})
        if (root / "optim.safetensors").is_file():
            optim = files.enter_context(safe_open(str(root / "optim.safetensors"), framework="pt"))
            for key in optim.keys():
                name, _, k = key.rpartition(SEP)
                stored[f"optim/{name}/{k}"] = (optim, key)
        slices = {fqn: f.get_slice(key) for fqn, (f, key) in stored.items()}
        saved = {
            fqn: TensorStorageMetadata(
                properties=TensorProperties(dtype=_DTYPES[sl.get_dtype()]),
                size=torch.Size(sl.get_shape()),
                chunks=[],
            )
            for fqn, sl in slices.items()
        }
        pieces = strategy.sharded_state(saved)
        if pieces is None:
            return None
        read = 0
        with torch.no_grad():
            for fqn, (size, parts) in trained_pieces(pieces, lora).items():
                if fqn not in slices:
                    raise KeyError(f"checkpoint {root} has no tensor {fqn!r}")
                f, key = stored[fqn]
                there = tuple(saved[fqn].size)
                if there != tuple(size):
                    raise ValueError(
                        f"checkpoint {root}: {fqn!r} is {there} there, {tuple(size)} in this module"
                    )
                for offsets, t in parts:
                    at = tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))
                    region = slices[fqn][at] if at else f.get_tensor(key)
                    t.copy_(region.view(t.shape))
                    read += region.numel() * region.element_size()
    return read


Optim = dict[str, dict[str, torch.Tensor]]


def _split(flat: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Optim]:
    """A sharded checkpoint's names (``param/<name>``, ``optim/<name>/<state>``) as the full form's."""
    params = {k[len("param/") :]: v for k, v in flat.items() if k.startswith("param/")}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for key, v in flat.items():
        if key.startswith("optim/"):
            name, _, k = key[len("optim/") :].rpartition("/")
            optim.setdefault(name, {})[k] = v
    return params, optim


def read_module_state(ckpt: Path, module: str) -> tuple[dict[str, torch.Tensor], Optim]:
    """A module's parameters and optimizer state from a checkpoint of either form, every
    tensor whole, in one process (no group): for what is small (a LoRA module's trained
    tensors, which ``disagg export`` writes as an adapter dir) and for tests."""
    root = Path(ckpt) / module
    if (root / "dcp" / ".metadata").is_file():
        import torch.distributed.checkpoint as dcp

        reader = dcp.FileSystemReader(str(root / "dcp"))
        saved = reader.read_metadata().state_dict_metadata
        flat = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in saved.items()}
        dcp.load(flat, storage_reader=reader, no_dist=True)
        return _split(flat)
    optim: dict[str, dict[str, torch.Tensor]] = {}
    if (root / "optim.safetensors").is_file():
        for key, v in load_file(str(root / "optim.safetensors")).items():
            name, _, k = key.rpartition(SEP)
            optim.setdefault(name, {})[k] = v
    return load_file(str(root / "full.safetensors")), optim


def load_full(
    strategy: Strategy, rank: int, ckpt: Path, module: str, restore_rng: bool, lora: LoraSpec | None = None
) -> int:
    """Take this rank's part of the module's state, saved full or sharded by any
    layout; with ``restore_rng`` (same layout as the save) continue its random
    streams too. With ``lora`` the checkpoint holds the trained tensors only; the
    frozen base is the module's own, as built from the model dir (it never changes).
    Collective. Returns the tensor bytes this rank read or gathered (from a sharded
    checkpoint, or a LoRA module's full-form one, under a strategy that states its layout:
    its own pieces only)."""
    root = Path(ckpt) / module
    if (root / "dcp" / ".metadata").is_file():
        read = _load_sharded(strategy, root, lora)
    else:
        read = _load_trained(strategy, root, lora) if lora is not None else None
        if read is None:
            params, optim = read_module_state(ckpt, module)
            read = sum(t.numel() * t.element_size() for t in params.values())
            read += sum(t.numel() * t.element_size() for st in optim.values() for t in st.values())
            if lora is not None:  # no stated layout: the base merged from the ranks' own, whole
                base = strategy.full_state_dict()
                read += sum(t.numel() * t.element_size() for k, t in base.items() if k not in params)
                params = {**base, **params}
            strategy.load_full_state(params, optim)
    set_schedule_state(strategy, json.loads((root / "schedule.json").read_text()))
    if restore_rng:
        path = root / "rng" / f"rank-{rank}.safetensors"
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["state"])
        set_rng_state(strategy, load_file(str(path)), meta)
    return read


# -- scheduler and optimizer hyper-parameters ----------------------------------------------------
def schedule_state(strategy: Strategy) -> dict[str, Any]:
    opt, sched = strategy.optimizer, strategy.scheduler
    groups = [] if opt is None else [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {"scheduler": sched.state_dict() if sched is not None else None, "param_groups": groups}


def set_schedule_state(strategy: Strategy, state: dict[str, Any]) -> None:
    opt, sched = strategy.optimizer, strategy.scheduler
    if sched is not None and state["scheduler"] is not None:
        sched.load_state_dict(state["scheduler"])
    if opt is not None:
        # the learning rate the schedule last set lives in the param groups
        for group, saved in zip(opt.param_groups, state["param_groups"]):
            for k, v in saved.items():
                group[k] = tuple(v) if isinstance(group.get(k), tuple) else v


# -- random streams --------------------------------------------------------------------------------
def rng_state(strategy: Strategy) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """torch (CPU and this rank's CUDA device), numpy, Python ``random`` and
    the strategy's own streams, as tensors plus a JSON-able rest."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["cuda"] = torch.cuda.get_rng_state()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    tensors["numpy"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    version, internal, gauss_next = random.getstate()
    tensors["python"] = torch.tensor(internal, dtype=torch.int64)
    for k, v in strategy.rng_state().items():
        tensors[f"strategy.{k}"] = v.detach().cpu()
    meta = {
        "numpy": [kind, int(pos), int(has_gauss), float(gauss)],
        "python": [version, gauss_next],
    }
    return {k: v.contiguous() for k, v in tensors.items()}, meta


def set_rng_state(strategy: Strategy, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])
    kind, pos, has_gauss, gauss = meta["numpy"]
    np.random.set_state((kind, tensors["numpy"].numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, gauss_next = meta["python"]
    random.setstate((version, tuple(int(x) for x in tensors["python"].tolist()), gauss_next))
    strategy.set_rng_state(
        {k[len("strategy.") :]: v for k, v in tensors.items() if k.startswith("strategy.")}
    )


# -- files -------------------------------------------------------------------------------------------
def file_digest(path: Path, sync: bool = False) -> dict[str, Any]:
    """sha256 and size of a file; with ``sync``, on disk first."""
    if sync:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"sha256": h.hexdigest(), "bytes": Path(path).stat().st_size}


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses shared storage (tied embeddings): store independent copies
    return {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}
