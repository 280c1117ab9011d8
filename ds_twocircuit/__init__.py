"""ds_twocircuit: communication-efficient GRPO post-training on a DeepSpeed pipeline over slow links.

The math imports with torch alone: grpo/ (loss, advantages, rollouts), codec/prf.py, lowrank.py,
geometry.py and boundary.py, anchor/sign.py and forecast.py, metrics.py and control.py. The
DeepSpeed glue is engine.py (building the pipeline), passes.py (its passes), clip.py, grads.py,
wire.py, comm.py and telemetry.py; model/pipe.py turns an HF model into the PipelineModule; the
step and the run loop are trainer.py; entry points are in launch/.
"""
__version__ = "0.1.0"
