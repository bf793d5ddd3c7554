"""disagg-audio: audio encoder families for disagg (registered by ``disagg_audio.plugin``)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("disagg-audio")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0"
