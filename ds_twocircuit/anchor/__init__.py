"""The anchor circuit: the dense anchor process (worker.py, managed by process.py), the trainer's side
of it (link.py), the files between them (mailbox.py), the correction it feeds (correction.py), and
its math (sign.py, forecast.py: pure)."""
