"""The boundary codec: what crosses a pipeline cut (prf.py, lowrank.py, boundary.py), where the cuts
are and how many channels they keep (geometry.py); generation through it for evaluation
(inference.py). The lowrank codec's first bases from the pipeline's own activations are
../calibration.py (it runs the pipeline)."""
