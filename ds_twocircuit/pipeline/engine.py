"""Building the DeepSpeed pipeline a process runs: its process group, its engine, the codec its
cuts read, and the one fact about its precision the rest of the code needs.

`Pipeline` bundles what every pass (passes.py) needs; `build_pipeline` makes one from an HF model
directory, our config and DeepSpeed's. The trainer builds one over all its stages, the anchor
process a one-stage one with the codec off.
"""
import copy
import os
from dataclasses import dataclass
from typing import Any

import deepspeed
import torch

from . import comm, recv_buffers, wire
from .clip import TrueNormClip
from ..codec.boundary import Codec, build_codec
from ..config.deepspeed_keys import engine_config
from ..model.pipe import TwoCircuitPipe, load_hf_config
from .passes import LastStage


def init_distributed(timeout_s: float) -> None:
    """gloo on CPU (DeepSpeed's CPU default, oneCCL, is rarely installed), the accelerator's own elsewhere
    (NCCL on GPUs), with the control path's gloo group beside it (comm.py); every collective of either
    waits at most `timeout_s` (train.collective_timeout).

    DeepSpeed's CPU backend also JIT-builds a shared-memory all-reduce op for inference and leaves a
    69 MB /dev/shm file per rank behind; training never uses it, so it is switched off here."""
    import datetime

    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() == "cpu":
        getattr(deepspeed.ops, "__compatible_ops__", {})["deepspeed_shm_comm"] = False
    backend = "gloo" if get_accelerator().device_name() == "cpu" else get_accelerator().communication_backend_name()
    if get_accelerator().device_name() != "cpu":   # this rank's device before any group: comm.device() reads it
        get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    comm.init(timeout_s)


def per_parameter_grads(ds_config: dict) -> bool:
    """fp32 without ZeRO: the optimizer steps each parameter's own .grad. Under bf16, fp16 or ZeRO-1
    it steps flat fp32 partitions instead (grads.py maps them back to parameters)."""
    return not (ds_config.get("bf16", {}).get("enabled") or ds_config.get("fp16", {}).get("enabled")
                or ds_config.get("zero_optimization", {}).get("stage", 0) > 0)


@dataclass
class Pipeline:
    engine: Any                 # deepspeed's PipelineEngine
    pipe: TwoCircuitPipe        # this rank's stage of the model
    codec: Codec                # what this rank's cuts read
    loss: LastStage             # DeepSpeed's loss_fn: the running pass's loss, on the last stage
    micro: int                  # sequences per micro-batch
    temperature: float          # log-probs are of softmax(logits/τ), the sampler's distribution
    per_param_grads: bool       # see per_parameter_grads
    clip: TrueNormClip
    share_group: int = 0        # grpo.share_prompts: G, each cut sends a group's prompt once; 0: off
    ends: tuple = ()            # global ranks of the first and last stages (and rank 0): what reads a batch's tokens
    ends_group: Any = None      # their device-path group (comm.subgroup)
    trim: str = "auto"          # train.trim_micro_batches: auto | always | never (passes.choose_layout)
    shape_key: tuple | None = None   # the last padded pass's (length, prompt columns shared, codec on); None after a trimmed one

    @property
    def stage(self) -> int:
        return self.pipe.stage_id

    @property
    def num_stages(self) -> int:
        return self.pipe.num_stages

    @property
    def last_stage(self) -> bool:
        return self.pipe.stage_id == self.pipe.num_stages - 1

    @property
    def dp(self) -> int:
        return self.engine.grid.data_parallel_size

    @property
    def dp_rank(self) -> int:
        return self.engine.grid.get_data_parallel_rank()


def configure_checkpointing(section: dict) -> None:
    """DeepSpeed's checkpoint function with the config's `activation_checkpointing` keys that act
    without tensor parallelism (config/deepspeed_keys.py refuses the others)."""
    deepspeed.checkpointing.configure(None, synchronize=section.get("synchronize_checkpoint_boundary", False),
                                      profile=section.get("profile", False))


def build_pipeline(model_dir: str, tc, ds_config: dict) -> Pipeline:
    """The engine over `tc.model.layers_per_stage`, DeepSpeed's own initialize. Clipping is taken out
    of DeepSpeed's hands where its norm is wrong (plain fp32, see clip.py); activation checkpointing
    recomputes runs of `pipeline.activation_checkpoint_interval` decoder layers (model/pipe.py)."""
    hf_config = load_hf_config(model_dir, tc.model.attn_implementation)
    codec = build_codec(tc.codec, hf_config.hidden_size, tc.model.layers_per_stage)
    loss = LastStage()
    pipe = TwoCircuitPipe(model_dir, tc.model.layers_per_stage, loss, tc.model.attn_implementation, codec=codec)
    ds = engine_config(copy.deepcopy(ds_config))
    if ds["pipeline"]["activation_checkpoint_interval"]:
        configure_checkpointing(ds.get("activation_checkpointing", {}))
    max_norm = ds.get("gradient_clipping", 1.0)   # DeepSpeed's default is 1.0
    per_param = per_parameter_grads(ds)
    if per_param:
        ds["gradient_clipping"] = 0.0
    if ds.get("bf16", {}).get("enabled") and ds.get("zero_optimization", {}).get("stage", 0) > 0:
        ds["bf16"].setdefault("check_grad_overflow", True)   # else its ZeRO path steps a NaN norm (guard.py)
    engine, _, _, _ = deepspeed.initialize(model=pipe, model_parameters=[p for p in pipe.parameters()
                                                                         if p.requires_grad], config=ds)
    recv_buffers.fit_dtypes(engine)
    wire.install(pipe.stage_id)
    wire.count_tied_grads(engine)
    if pipe.stage_id == 0 and engine.grid.get_data_parallel_rank() == 0:
        weights, accum = engine.get_data_types()
        hint = " (zero_optimization.stage=1 accumulates them in float32)" if accum == torch.bfloat16 else ""
        print(f"[deepspeed] {type(engine.optimizer).__name__}: weights in {str(weights).removeprefix('torch.')}, "
              f"gradients accumulated in {str(accum).removeprefix('torch.')}{hint}", flush=True)
    if pipe.activation_checkpoint_interval and pipe.stage_id == 0 and engine.grid.get_data_parallel_rank() == 0:
        kind = "non-reentrant" if ds["pipeline"].get("use_reentrant") is False else "reentrant"
        print(f"activation checkpointing ({kind}): every {pipe.activation_checkpoint_interval} decoder layer(s); "
              f"stage 0 recomputes {sum(pipe.is_checkpointable_results)} of {len(pipe.is_checkpointable_results)} "
              "layer runs", flush=True)
    grid = engine.grid
    ends = tuple(sorted({0} | {grid.stage_to_global(stage_id=s, data=d) for s in (0, grid.pipe_parallel_size - 1)
                               for d in range(grid.data_parallel_size)}))
    return Pipeline(engine=engine, pipe=pipe, codec=codec, loss=loss, micro=ds["train_micro_batch_size_per_gpu"],
                    temperature=tc.grpo.temperature, per_param_grads=per_param,
                    clip=TrueNormClip(engine, pipe, max_norm, per_param),
                    share_group=tc.grpo.group_size if tc.grpo.share_prompts else 0, trim=tc.train.trim_micro_batches,
                    ends=ends, ends_group=comm.subgroup(list(ends)))
