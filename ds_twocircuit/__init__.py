"""ds_twocircuit: communication-efficient GRPO post-training on a DeepSpeed pipeline over slow links.

The core (grpo/, data/, metrics) imports with torch alone; DeepSpeed glue lives in engine.py and
model/pipe.py, the run loop in trainer.py, entry points in launch/.
"""
__version__ = "0.1.0"
