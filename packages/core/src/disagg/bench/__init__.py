"""``disagg bench``: the same model and data under several parallel layouts,
measured in one run, reported as ratios and machine-independent byte counts."""
