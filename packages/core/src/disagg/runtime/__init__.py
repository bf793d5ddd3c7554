"""What runs inside and around the Ray actors: collectives, workers, groups."""
