"""disagg: disaggregated hybrid parallelism for multimodal training on Ray."""

from importlib.metadata import PackageNotFoundError, version

import pluggy

try:
    __version__ = version("disagg-core")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0"

#: Decorator plugin authors put on their hook implementations.
hookimpl = pluggy.HookimplMarker("disagg")

__all__ = ["hookimpl", "__version__"]

# known third-party console noise, filtered in every process that imports disagg (driver,
# actors, Ray Data tasks) unless DISAGG_VERBOSE=1; see disagg.noise
from disagg import noise as _noise  # noqa: E402

_noise.install()
