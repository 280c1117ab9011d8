"""What a CUDA machine must show, skipped with its reason where there is none (this project's CI).

Run on a machine with 1–8 NVIDIA GPUs, after `pip install torch -e '.[test,vllm]'` (the CUDA build
of torch, not the CPU pin; see the README):

    python -m pytest -m gpu tests/test_gpu.py

- the pipeline's logits on CUDA over NCCL equal HF's (fp32, the same check as the CPU one at
  `test_pipeline.py`, at as many stages as there are GPUs, up to 8);
- vLLM's CUDA engine: sampled-token log-probs equal HF fp32's before and after an in-place weight
  update (the CPU engine's test, run on the CUDA platform);
- a bf16 run through DeepSpeed's launcher: 8 layers over the GPUs, the bf16 optimizer, PRF
  boundaries, 3 GRPO steps with a codec-off probe each: finite losses, the bf16 pipeline's gap to
  the fp32 HF sampler reported, the export reloadable.

None of these has run yet: no GPU has been lent to this project's machines.
"""
import json
import subprocess

import pytest
import torch

from conftest import ROOT, TINY, ds_cmd, launch, rows, stages

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.dist,
              pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)")]


def n_gpus() -> int:
    n = min(torch.cuda.device_count(), 8)
    return n if 8 % n == 0 else max(d for d in (1, 2, 4) if d <= n)   # 8 layers split evenly


def test_pipeline_logits_on_cuda_nccl_equal_hf(tiny_model, tmp_path):
    """As test_pipeline_logits_match_hf, over NCCL: the last stage's CUDA logits against HF fp32 on
    the CPU. 1e-4, not the CPU test's 1e-5: CUDA's fp32 kernels (SDPA, GEMM) sum in other orders."""
    n, out = n_gpus(), tmp_path / "logits.json"
    split = json.dumps([int(x) for x in stages(n).split("=")[1].strip("[]").split(",")])
    p = subprocess.run(ds_cmd(n, "tests/dist_logits.py", tiny_model, split, out, real=True), cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["stages"] == n and res["device"].startswith("cuda") and res["max_abs_diff"] < 1e-4, res


def test_vllm_cuda_engine_loads_weights(tiny_model):
    pytest.importorskip("vllm", reason="vllm not installed (pip install -e '.[vllm]')")
    from vllm.platforms import current_platform

    from ds_twocircuit.config.schema import SamplerConfig
    from ds_twocircuit.sampler.vllm import VLLMSampler
    from test_vllm import test_logprobs_equal_hf_before_and_after_a_weight_update as check
    assert current_platform.is_cuda(), current_platform
    engine = VLLMSampler(tiny_model, SamplerConfig(backend="vllm"), max_model_len=256, seed=0)
    try:
        check(engine, tiny_model)
    finally:
        engine.close()


def test_bf16_run_through_the_launcher(tiny_model, tmp_path):
    n = n_gpus()
    cfg = json.loads(TINY.read_text())
    cfg["bf16"] = {"enabled": True}
    (tmp_path / "bf16.json").write_text(json.dumps(cfg))
    launch(n, tmp_path / "run", stages(n), "codec.name=prf", "train.steps=3", "train.probe_every=1",
           config=tmp_path / "bf16.json", real=True, timeout=600)
    r = rows(tmp_path / "run")
    assert [x["step"] for x in r] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor([x["actor/pg_loss"], x["actor/grad_norm"]])).all() for x in r)
    gap = [x["probe/rollout_corr/logp_diff_mean"] for x in r]
    assert all(1e-5 < g < 0.5 for g in gap), gap                 # bf16 pipeline vs fp32 sampler
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model")
