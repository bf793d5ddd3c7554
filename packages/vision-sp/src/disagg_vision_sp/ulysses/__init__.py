"""Ulysses sequence parallelism: layout and cuts, the attention hook, the strategy."""
