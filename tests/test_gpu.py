"""What a CUDA machine must show, skipped with its reason where there is none (this project's CI).

Run on a machine with 1–8 NVIDIA GPUs, after `pip install torch -e '.[test,vllm]'` (the CUDA build
of torch, not the CPU pin; see the README):

    python -m pytest -m gpu tests/test_gpu.py

- the pipeline's logits on CUDA over NCCL equal HF's (fp32, the same check as the CPU one at
  `test_pipeline.py`, at as many stages as there are GPUs, up to 8; 2 GPUs at least);
- (4 GPUs at least) compressed cuts over NCCL: tests/dist_grads.py's launch at 4 stages, PRF and the
  rotated codec on trimmed micro-batches and on cuts that differ in wire dtype, each stage's
  gradients against the same launch on gloo (CPU), with a 60 s collective timeout so a hang fails;
- vLLM's CUDA engine: sampled-token log-probs equal HF fp32's before and after an in-place weight
  update (the CPU engine's test, run on the CUDA platform);
- a bf16 run through DeepSpeed's launcher: 8 layers over the GPUs, the bf16 optimizer, PRF
  boundaries, 3 GRPO steps with a codec-off probe each: finite losses, the bf16 pipeline's gap to
  the fp32 HF sampler reported, the export reloadable;
- the whole product: bf16 with ZeRO-1 (fp32 accumulation), as many stages as GPUs, PRF cuts, the
  anchor in its own process (sync, every step), the vLLM sampler (the HF one where vLLM is not
  installed), every collective recorded and on a backend that takes it, rank 0 killed as it saves
  step 2's checkpoint and the run resumed to step 3; no "silently incorrect" warning in any output;
- the stage chain of test_device.py (every codec, the loss) forward and backward on CUDA;
- the HF sampler and the reference policy on CUDA: the same greedy tokens as on the CPU, log-probs
  within 1e-4, everything they return on the host.

`python launch/gpu_check.py` runs them all and prints one line per check: all passed on one H100
on 2026-12-06 in 180 s (vLLM's checks skipped there: not installed).
"""
import json
import os
import subprocess

import pytest
import torch

from conftest import ROOT, TINY, ds_cmd, launch, rows, stages

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.dist,
              pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)")]


def need_gpus(k: int) -> None:
    """Skip a multi-stage check on a machine with fewer than k GPUs, saying so (gpu_check.py's summary
    counts these)."""
    if torch.cuda.device_count() < k:
        pytest.skip(f"multi-stage: needs {k} GPUs, found {torch.cuda.device_count()}")


def n_gpus() -> int:
    n = min(torch.cuda.device_count(), 8)
    return n if 8 % n == 0 else max(d for d in (1, 2, 4) if d <= n)   # 8 layers split evenly


def test_pipeline_logits_on_cuda_nccl_equal_hf(tiny_model, tmp_path):
    """As test_pipeline_logits_match_hf, over NCCL: the last stage's CUDA logits against HF fp32 on
    the CPU. 1e-4, not the CPU test's 1e-5: CUDA's fp32 kernels (SDPA, GEMM) sum in other orders.
    At least 2 stages: on one GPU there is no boundary to cross."""
    need_gpus(2)
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
    engine = VLLMSampler(tiny_model, SamplerConfig(backend="vllm", dtype="float32"), max_model_len=256, seed=0)
    try:
        check(engine, tiny_model)
    finally:
        engine.close()


def test_compressed_trimmed_cuts_on_nccl_equal_gloo(tiny_model, tmp_path):
    """What crosses NCCL at a compressed cut: a send and its receive must agree in datatype and count,
    which gloo does not enforce. tests/dist_grads.py's launch at 4 stages (2 layers each) over NCCL,
    with the wire's strict check, and the same on gloo on this machine's CPU: each stage's gradients
    agree, PRF to 1e-4 of a tensor's largest element (CUDA's fp32 kernels sum in other orders), the
    rotated codec to 2 % (a float-order difference can move a quantized coordinate by one level of its
    grid; a chosen bound, not yet measured on a 4-GPU machine)."""
    need_gpus(4)
    from safetensors.torch import load_file
    split, specs = [2, 2, 2, 2], ("3t", "3ts", "r32x4/20x2t", "c1:r32x4/20x2t", "c3:r32x4/20x2")
    runs = {}
    for name, env in (("nccl", {}), ("gloo", {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"})):
        out = tmp_path / name
        p = subprocess.run(ds_cmd(4, "tests/dist_grads.py", tiny_model, json.dumps(split), ",".join(specs), out, 60,
                                  real=True), cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, f"{name}: " + p.stdout[-3000:] + p.stderr[-3000:]
        runs[name] = out
    for k in specs:
        got, want = ({n: t for f in (runs[r] / f"k{k.replace('/', '_')}").glob("grads_stage*.safetensors")
                      for n, t in load_file(f).items()} for r in ("nccl", "gloo"))
        assert got.keys() == want.keys() and got
        tol = 1e-4 if not k.split(":")[-1].startswith("r") else 2e-2
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=0, atol=tol * float(want[n].abs().max()) + 1e-7,
                                       msg=f"{k} {n}")


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


def test_the_whole_product_on_cuda_with_a_kill_and_a_resume(tiny_model, tmp_path):
    """With vLLM installed its sampler, else the HF one (printed: the check's line says which)."""
    import importlib.util
    backend = "vllm" if importlib.util.find_spec("vllm") else "hf"
    print(f"sampler backend: {backend}")
    n = n_gpus()
    cfg = json.loads(TINY.read_text())
    cfg.update(bf16={"enabled": True}, zero_optimization={"stage": 1})
    (tmp_path / "bf16.json").write_text(json.dumps(cfg))
    run, calls = tmp_path / "run", tmp_path / "collectives"
    args = (stages(n), "codec.name=prf", "anchor.enabled=true", "anchor.mode=sync", "anchor.every=1",
            "anchor.staleness=1", "anchor.timeout=300", f"sampler.backend={backend}", "train.steps=3",
            "train.save_every=1", "train.probe_every=1",
            *(["sampler.gpu_memory_utilization=0.2", "sampler.enforce_eager=true"] if backend == "vllm" else []))
    killed = launch(n, run, *args, config=tmp_path / "bf16.json", real=True, timeout=600, check=False,
                    env={"DS_TWOCIRCUIT_KILL_AT": "save@2@0", "DS_TWOCIRCUIT_RECORD_COLLECTIVES": str(calls)})
    assert killed.returncode != 0 and (run / "checkpoints" / "latest").read_text().strip() == "step1", \
        killed.stdout[-3000:] + killed.stderr[-3000:]
    resumed = launch(n, run, *args, config=tmp_path / "bf16.json", resume=True, real=True, timeout=600)
    out = killed.stdout + killed.stderr + resumed.stdout + resumed.stderr
    assert "silently incorrect" not in out and "gradients accumulated in float32" in out, out[-3000:]
    r = rows(run)
    assert [x["step"] for x in r] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor([x["actor/pg_loss"], x["actor/grad_norm"], x["anchor/fire"]
                                            if "anchor/fire" in x else 0.0])).all() for x in r)
    import test_control_plane
    for device, recorded in test_control_plane.recorded(tmp_path):
        assert device.startswith("cuda"), device
        for c in recorded:
            if c["caller"] != "deepspeed":
                assert (c["control"] and set(c["devices"]) <= {"cpu"}) or set(c["devices"]) == {device}, c
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(run / "model")


@pytest.mark.parametrize("share", [False, True], ids=["unshared", "shared"])
@pytest.mark.parametrize("name", ["dense", "prf", "lowrank", "rotated", "rotated_gauss", "rotated_rank"])
def test_stages_codecs_and_loss_on_cuda(tiny_model, name, share):
    """test_device.py's chain (embedding, a compressed cut's two decoder layers, norm, head, the
    last stage's loss) forward and backward on a real CUDA device, every codec."""
    from test_device import Placement, run_chain
    run_chain(tiny_model, name, share, Placement("cuda"))


def test_hf_sampler_and_reference_on_cuda(tiny_model):
    """Without vLLM rank 0 generates with HF `generate` on its own GPU (sampler/hf.py), and the reference
    policy scores there (sampler/reference.py): the same greedy tokens as on the CPU, log-probs within
    1e-4 (CUDA's fp32 kernels sum in other orders), all of it handed back on the host."""
    from ds_twocircuit.sampler.hf import HFSampler
    from ds_twocircuit.sampler.reference import ReferenceLogProbs
    prompts = ["12+3=", "7+8=", "40-9="]
    cpu, gpu = HFSampler(tiny_model), HFSampler(tiny_model, device="cuda")
    assert next(gpu.model.parameters()).device.type == "cuda"
    a, b = (s.generate(prompts, 2, greedy=True, max_new_tokens=8) for s in (cpu, gpu))
    assert b.ids_NT.device.type == "cpu" and b.logp_NT1.device.type == "cpu"
    assert a.texts == b.texts and torch.equal(a.ids_NT, b.ids_NT)
    torch.testing.assert_close(b.logp_NT1, a.logp_NT1, rtol=0, atol=1e-4)
    ref_cpu, ref_gpu = ReferenceLogProbs(tiny_model), ReferenceLogProbs(tiny_model, device="cuda")
    want, got = (r(a.ids_NT, a.attn_NT, a.resp_NT1, 0.7) for r in (ref_cpu, ref_gpu))
    assert got.device.type == "cpu"
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
