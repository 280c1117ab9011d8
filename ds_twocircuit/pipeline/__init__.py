"""The DeepSpeed pipeline a process runs, and what touches it.

engine.py builds it (process group, PipelineModule, DeepSpeed's engine, the codec its cuts read);
passes.py runs its passes (log-probs, updates, the dense gradient without an optimizer step);
step_order.py, clip.py, grads.py and guard.py are the optimizer step (its order, the true-norm clip,
the gradient views and comparison, the non-finite guard); wire.py counts the bytes between stages;
comm.py broadcasts a batch from rank 0; calibration.py reads what crosses the cuts (the lowrank
codec's first bases).
"""
