"""Step metrics: the JSONL logger (a built-in plugin), progress bar and summary."""
