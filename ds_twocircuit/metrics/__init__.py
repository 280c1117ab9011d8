"""What a run measures and writes: health.py, the pure health metrics (sampler–trainer mismatch,
trends); telemetry.py, each rank's partial sums and their reduction to rank 0's row; logger.py, the
row to metrics.jsonl, wandb and DeepSpeed's monitors."""
