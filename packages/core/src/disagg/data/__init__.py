"""The data pipeline: datasets, preprocessing in Ray workers, ObjectRefs for the groups."""

from disagg.data.types import DataSource, SampleRefs

__all__ = ["DataSource", "SampleRefs"]
