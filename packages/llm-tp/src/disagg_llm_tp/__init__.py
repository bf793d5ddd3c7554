"""disagg-llm-tp: the ``megatron_tp`` strategy and the ``qwen2`` / ``llama`` /
``qwen2_5_vl`` language-model families."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("disagg-llm-tp")
except PackageNotFoundError:  # source tree without install
    __version__ = "0.0.0"
