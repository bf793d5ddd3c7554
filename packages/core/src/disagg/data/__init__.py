"""The data pipeline: datasets, preprocessing in Ray workers, ObjectRefs for the groups."""

from disagg.data.errors import DataError
from disagg.data.types import DataSource, SampleRefs

__all__ = ["DataError", "DataSource", "SampleRefs", "build_data_source"]


def __getattr__(name: str):
    # lazy: importing disagg.data must not import ray (the config/CLI paths stay light)
    if name == "build_data_source":
        from disagg.data.source import build_data_source

        return build_data_source
    raise AttributeError(name)
