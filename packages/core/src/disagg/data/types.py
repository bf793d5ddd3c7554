"""What the data pipeline hands the orchestrator: ObjectRefs plus small metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol


@dataclass
class SampleRefs:
    """One preprocessed sample, living in the Ray object store.

    ``inputs[module]`` is an ObjectRef of that module's input dict: for the
    ``llm`` module at least ``input_ids`` and ``labels`` (int64 ``[L]``, labels
    -100 where no loss) plus family extras; for an encoder module the dict its
    family's ``preprocess`` returned. A module missing from ``inputs`` has no
    media in this sample. The driver reads only the ints below, never tensors.
    """

    index: int
    inputs: dict[str, Any]
    num_label_tokens: int
    num_tokens: int
    #: where it came from, for error messages: "train.jsonl:17"
    source: str = ""
    #: placeholder tokens per encoder module, so routing can be planned
    num_media_tokens: dict[str, int] = field(default_factory=dict)
    #: per encoder module, a digest of the sample's media as preprocessed (a feature cache
    #: key's content part); empty where the source computes none (never cached)
    media_digest: dict[str, str] = field(default_factory=dict)


class DataSource(Protocol):
    """A deterministic stream of global batches.

    A source that can skip samples (``data.on_error: skip``) also has
    ``state() -> dict`` (JSON: where the stream stands after the last batch
    handed out; the run saves it with each checkpoint) and accepts it back as
    ``batches(start_step, state=...)`` to resume exactly there.
    """

    def batches(self, start_step: int = 0) -> Iterator[list[SampleRefs]]:
        """Global batches from optimizer step ``start_step`` on (resumable)."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters for metrics: at least ``skipped`` and ``dropped_too_long``."""
        ...
