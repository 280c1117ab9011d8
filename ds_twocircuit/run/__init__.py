"""A run's files on disk: crash-safe checkpoints (checkpoint.py), atomic writes (files.py), what the
run was made from (provenance.py), and the test hooks that kill or stall processes (faults.py)."""
