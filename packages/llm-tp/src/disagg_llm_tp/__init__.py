"""disagg-llm-tp: the ``megatron_tp`` strategy and the ``qwen2`` / ``llama`` /
``qwen2_5_vl`` language-model families."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("disagg-llm-tp")
except PackageNotFoundError:  # source tree without install
    __version__ = "0.0.0"

import warnings as _warnings

# megatron-core warns on import when the optional CUDA extensions are absent;
# its pure-torch fallbacks are what the CPU path uses, so say nothing.
_warnings.filterwarnings("ignore", message=r".*Transformer Engine and Apex are not installed.*")
_warnings.filterwarnings("ignore", message=r".*imports from `dynamic_context.py` will be removed.*")
