"""The ``disagg`` command line: one module per subcommand, listed in ``main.COMMANDS``."""
