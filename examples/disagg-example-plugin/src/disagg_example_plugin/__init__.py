"""An example third-party disagg plugin (see ``plugin.py``)."""
