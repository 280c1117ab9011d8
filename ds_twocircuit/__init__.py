"""ds_twocircuit: communication-efficient GRPO post-training on a DeepSpeed pipeline over slow links.

The package, each layer using only those below it:

    trainer.py          the step and the run loop, over its components:
      rollout_side.py     task, sampler, scoring, reference log-probs, evaluation (rank 0; others receive)
      actor.py            the compressed pipeline's probe and update, in one step context
      step_log.py         the row to the logger on rank 0 (a do-nothing twin elsewhere), the controller
    anchor/             the dense anchor process, its mailbox and the sign correction
    sampler/            the dense sampler: HF or vLLM, and the reference model beside it
    pipeline/           the DeepSpeed glue: engine, passes, the optimizer step's order, wire counts
    sync/               weights to the sampler as lossless deltas
    metrics/            health metrics, each rank's telemetry, the logger
    run/                checkpoints, atomic files, the crash tests' fault points
    model/, data/       the PipelineModule over an HF model; the tasks and their verifiers
    codec/, grpo/       the math: boundary codecs; GRPO loss, advantages, rollouts
    config/             our config (OmegaConf) and the checks on DeepSpeed's

The math imports with torch alone: grpo/, codec/ (prf, lowrank, rotated, geometry, boundary),
anchor/sign.py and forecast.py, metrics/health.py, control.py, evaluation.py and sync/delta.py.
Entry points are in launch/.
"""
__version__ = "0.1.0"
