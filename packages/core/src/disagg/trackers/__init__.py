"""First-party experiment trackers (``logging.trackers``), each an optional extra:
``pip install 'disagg-core[trackers]'`` installs all three."""
