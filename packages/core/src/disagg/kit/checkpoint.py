"""``torch.distributed.checkpoint`` planners over pieces of full tensors.

A rank's state is given as :data:`~disagg.kit.roles.state.Pieces`: per
full-form name, the full tensor's shape and the pieces this rank holds, each
at its offsets in the full tensor. That describes what ShardedTensor and
DTensor cannot (a tensor-parallel rank's rows of each block of a fused q/k/v
projection, a vocabulary cut after padding, a key/value head copied on several
ranks) without either. Saving, every holder lists its pieces and DCP's own
de-duplication of equal write items picks one writer per piece (spread over
the ranks); loading, DCP's resharding (``create_read_items_for_chunk_list``)
reads exactly the stored regions that overlap this rank's pieces, whatever
layout wrote them. DCP fills the pieces in place, so a load's pieces alias the
live parameters and optimizer state.

Here in the kit (not the runtime) so that a strategy's tests can
round-trip its :meth:`~disagg.kit.roles.state.StateAdapter.sharded_state`
through DCP as the actor's checkpoint does (:func:`save_pieces`, :func:`load_pieces`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from disagg.kit.roles.state import Pieces


def _find(pieces: Pieces, index: MetadataIndex) -> torch.Tensor:
    for offsets, t in pieces[index.fqn][1]:
        if torch.Size(offsets) == index.offset:
            return t
    raise KeyError(f"no piece of {index.fqn!r} at {tuple(index.offset or ())}")


class PieceSavePlanner(DefaultSavePlanner):
    """Writes the pieces (``dcp.save`` is given an empty state dict)."""

    def __init__(self, pieces: Pieces) -> None:
        super().__init__()
        self.pieces = pieces

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, (size, parts) in self.pieces.items():
            for offsets, t in parts:
                at = torch.Size(offsets)
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, at),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=at, sizes=t.size()),
                            properties=TensorProperties.create_from_tensor(t),
                            size=torch.Size(size),
                        ),
                    )
                )
        self.plan = SavePlan(items, planner_data={fqn: (fqn,) for fqn in self.pieces})
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return _find(self.pieces, index).detach().cpu().contiguous()


class PieceLoadPlanner(DefaultLoadPlanner):
    """Fills the pieces in place from whatever layout saved them."""

    def __init__(self, pieces: Pieces, where: str) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces, self.where = pieces, where
        #: tensor bytes this rank's plan reads (the stored regions overlapping its pieces)
        self.bytes_read = 0

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        stored = self.metadata.state_dict_metadata
        items = []
        for fqn, (size, parts) in self.pieces.items():
            md = stored.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise KeyError(f"checkpoint {self.where} has no tensor {fqn!r}")
            if tuple(md.size) != tuple(size):
                raise ValueError(
                    f"checkpoint {self.where}: {fqn!r} is {tuple(md.size)} there, "
                    f"{tuple(size)} in this module"
                )
            chunks = [ChunkStorageMetadata(torch.Size(o), t.size()) for o, t in parts]
            mine = create_read_items_for_chunk_list(fqn, md, chunks)
            self.bytes_read += sum(math.prod(i.lengths) for i in mine) * md.properties.dtype.itemsize
            items += mine
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _find(self.pieces, index)


def save_pieces(pieces: Pieces, where: str | Path) -> None:
    """Write this rank's ``pieces`` into the DCP dir ``where`` (collective over the default
    process group: every rank of the module's group calls it)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({}, checkpoint_id=str(where), planner=PieceSavePlanner(pieces))


def load_pieces(
    pieces_for: Callable[[Mapping[str, Any]], Pieces | None], where: str | Path, label: str
) -> int | None:
    """Fill the pieces ``pieces_for(stored tensor metadata)`` gives from the DCP dir ``where``
    (collective); ``label`` names the checkpoint in errors. Returns the tensor bytes this rank
    read, or ``None`` (nothing read) when ``pieces_for`` gives ``None``."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(where))
    pieces = pieces_for(reader.read_metadata().state_dict_metadata)
    if pieces is None:
        return None
    planner = PieceLoadPlanner(pieces, label)
    dcp.load({}, storage_reader=reader, planner=planner)
    return planner.bytes_read


def payload_by_file(where: str | Path) -> dict[str, int]:
    """Tensor bytes each file of the DCP dir ``where`` holds (by its metadata's chunks,
    headers aside): how evenly a sharded checkpoint spread over the ranks."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(where)).read_metadata()
    out: dict[str, int] = {}
    for index, info in md.storage_data.items():
        tensor = md.state_dict_metadata[index.fqn]
        assert isinstance(tensor, TensorStorageMetadata)
        chunk = next(c for c in tensor.chunks if tuple(c.offsets) == tuple(index.offset))
        n = math.prod(chunk.sizes) * tensor.properties.dtype.itemsize
        out[info.relative_path] = out.get(info.relative_path, 0) + n
    return out
