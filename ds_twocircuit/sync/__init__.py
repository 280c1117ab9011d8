"""Weights leaving the pipeline for the sampler: lossless deltas in the sampler's dtype (delta.py, the
codec; weight_sync.py, the transfer from every stage to the sampler's rank)."""
