"""A run's files on disk: crash-safe checkpoints (checkpoint.py), atomic writes (files.py), and the
fault points the crash tests kill processes at (faults.py)."""
