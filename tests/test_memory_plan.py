"""The memory plan (config/memory.py): what each GPU holds, and the trainer refusing on CUDA, before
any process group, a placement that leaves a GPU under 10 % free, naming the key to move."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
from conftest import ROOT, TINY

from ds_twocircuit.config import ConfigError, config_from_dict
from ds_twocircuit.config.checks import EMBEDDED_VOCAB, model_config
from ds_twocircuit.config.memory import GiB, Shape, check_placement, placement_plan, refuse_crowded

RECIPE = ROOT / "ds_configs" / "prf95_qwen1p5b.json"
# Qwen2.5-Math-1.5B's config.json, the keys the plan reads (the recipe's model, without a download)
QWEN_1P5B = {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "vocab_size": 151_936, "tie_word_embeddings": True, "model_type": "qwen2"}


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen1p5b")
    (d / "config.json").write_text(json.dumps(QWEN_1P5B))
    return d


def recipe(qwen_dir, *overrides, world_size=8):
    return config_from_dict(json.loads(RECIPE.read_text()), [f"model.path={qwen_dir}", *overrides], world_size,
                            read_data=False)


def totals(plan) -> dict[str, float]:
    return {g: round(sum(p.gib for p in ps), 1) for g, ps in plan.items()}


def test_the_1p5b_recipe_fits_and_its_anchor_beside_stage_0_and_vllm_is_refused(qwen_dir):
    """As shipped (anchor beside stage 6) every GPU of an H100 node keeps over 10 % free; the anchor
    on rank 0's GPU (anchor.device=-1) puts 73.2 GiB there, beside stage 0 and vLLM's 0.3 of the
    device, and is refused naming anchor.device. The parameter count is the model's (1.54 B), stage 0's
    training state 20 bytes a parameter."""
    run = recipe(qwen_dir)
    shape = Shape.from_hf(model_config(run.tc.model))
    assert round(shape.params() / 1e6) == 1544
    plan = placement_plan(run.tc, run.ds, shape, 8, 8, 78.0)
    assert list(plan) == [f"GPU {i}" for i in range(8)]
    assert [p.name for p in plan["GPU 0"]] == ["stage 0", "the vLLM sampler"]
    assert [p.name for p in plan["GPU 6"]] == ["stage 6", "the anchor"]
    stage0 = 4 * shape.layer_params() + 151_936 * 1536
    assert plan["GPU 0"][0].parts["training state"] == pytest.approx(20 * stage0 / GiB)
    assert totals(plan) == {"GPU 0": 34.1, "GPU 1": 6.2, "GPU 2": 6.0, "GPU 3": 5.8, "GPU 4": 4.6, "GPU 5": 4.4,
                            "GPU 6": 43.4, "GPU 7": 11.0}
    refuse_crowded(plan, 78.0)
    shared = placement_plan(*(lambda r: (r.tc, r.ds))(recipe(qwen_dir, "anchor.device=-1")), shape, 8, 8, 78.0)
    assert totals(shared)["GPU 0"] == 73.2
    with pytest.raises(ConfigError, match=r"^anchor.device=-1: GPU 0 would hold stage 0, the vLLM sampler, the "
                                          r"anchor: 73.2 of 78 GiB .* under 10 % free"):
        refuse_crowded(shared, 78.0)
    refuse_crowded(shared, 82.0)   # 73.2 leaves 10.7 % of 82 free


def test_the_hf_sampler_and_reference_on_rank_0s_gpu_are_planned(qwen_dir):
    """With the HF backend the sampler's kept logits (one fp32 (N, V) row per new token: 4096 samples
    × 3072 tokens × V at 1.5B) cannot fit any GPU: refused naming sampler.backend. The HF reference
    (grpo.ref_logprobs=sampler) adds its fp32 weights and a forward of 64 rows: 61 GiB on GPU 0 with
    vLLM beside it, still over 10 % free of 78."""
    run = recipe(qwen_dir, "sampler.backend=hf")
    shape = Shape.from_hf(QWEN_1P5B)
    plan = placement_plan(run.tc, run.ds, shape, 8, 8, 78.0)
    hf = plan["GPU 0"][1]
    assert hf.name == "the HF sampler"
    assert hf.parts["kept logits"] == pytest.approx(3072 * 4096 * 151_936 * 4 / GiB)
    assert hf.parts["weights"] == pytest.approx(shape.params() * 2 / GiB)      # sampler.dtype bfloat16
    with pytest.raises(ConfigError, match=r"^sampler.backend=hf: GPU 0 would hold stage 0, the HF sampler"):
        refuse_crowded(plan, 78.0)
    run = recipe(qwen_dir, "grpo.ref_logprobs=sampler")
    plan = placement_plan(run.tc, run.ds, shape, 8, 8, 78.0)
    assert [p.name for p in plan["GPU 0"]] == ["stage 0", "the vLLM sampler", "the HF reference"]
    assert totals(plan)["GPU 0"] == 61.1
    refuse_crowded(plan, 78.0)


def test_gpus_are_named_as_the_launcher_placed_them(qwen_dir):
    """Stages sit on CUDA_VISIBLE_DEVICES in local-rank order; anchor.device is a physical index:
    beside the stage on that GPU, or a GPU of its own. On 16 ranks over two nodes (dp 2), rank 0's node
    holds stages 0-3, two ranks each, and the others are checked a GPU each."""
    run = recipe(qwen_dir, "anchor.device=9")
    shape = Shape.from_hf(QWEN_1P5B)
    plan = placement_plan(run.tc, run.ds, shape, 8, 8, 78.0, visible=[2, 3, 4, 5, 6, 7, 8, 9])
    assert [p.name for p in plan["GPU 9"]] == ["stage 7", "the anchor"]
    assert [p.name for p in plan["GPU 2"]] == ["stage 0", "the vLLM sampler"]
    run = recipe(qwen_dir, "anchor.device=8")
    own = placement_plan(run.tc, run.ds, shape, 8, 8, 78.0, visible=list(range(8)))
    assert [p.name for p in own["GPU 8"]] == ["the anchor"]
    run = recipe(qwen_dir, "anchor.device=-1", "ds.train_micro_batch_size_per_gpu=2", world_size=16)
    two = placement_plan(run.tc, run.ds, shape, 16, 8, 78.0)
    assert [[p.name for p in two[f"GPU {i}"]][0] for i in range(8)] == [f"stage {i // 2}" for i in range(8)]
    assert list(two)[8:] == [f"stage {s}'s GPU" for s in range(4, 8)]
    # ZeRO-1 splits the fp32 master weights and Adam's moments over the two replicas: 14 bytes a parameter
    p0 = 4 * shape.layer_params() + 151_936 * 1536
    assert two["GPU 0"][0].parts["training state"] == pytest.approx(14 * p0 / GiB)


def test_the_embedded_model_is_planned_from_its_own_shape(tiny_model):
    """The embedded model's shape as its built config.json gives it; the tests' recipe's GPUs hold far
    under 1 GiB, and the trainer's check passes it."""
    from ds_twocircuit.config import load_config
    run = load_config(str(TINY), [], 8)
    built = json.loads((pathlib.Path(tiny_model) / "config.json").read_text())
    assert Shape.from_hf(model_config(run.tc.model)) == Shape.from_hf(built)
    assert model_config(run.tc.model)["vocab_size"] == EMBEDDED_VOCAB == built["vocab_size"]
    plan = placement_plan(run.tc, run.ds, Shape.from_hf(built), 8, 8, 78.0)
    assert max(sum(p.gib for p in ps) for ps in plan.values()) < 1
    check_placement(run, 78.0, {"LOCAL_SIZE": "8"})


def test_the_trainer_refuses_a_crowded_gpu_before_any_process_group(qwen_dir, tmp_path):
    """launch/train.py on a (pretended) 78 GiB CUDA device, as rank 0 of 8: the 1.5B recipe with the
    anchor beside stage 0 stops with exit status 2 and the plan's one line, before the rendezvous
    (nothing listens at MASTER_PORT) and before the run dir is written."""
    raw = json.loads(RECIPE.read_text())
    raw["twocircuit"]["data"] = {"max_prompt_len": 1024}    # the synthetic task: no data set to fetch
    cfg = tmp_path / "prf95_qwen1p5b.json"
    cfg.write_text(json.dumps(raw))
    code = ("import sys; sys.path.insert(0, 'launch'); import train; train.cuda_gib = lambda: 78.0; "
            f"train.main(['--ds-config', {str(cfg)!r}, '--run-dir', {str(tmp_path / 'run')!r}, "
            f"'model.path={qwen_dir}', 'anchor.device=-1'])")
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "8", "LOCAL_SIZE": "8",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "WANDB_MODE": "disabled"}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [l for l in p.stderr.splitlines() if "anchor.device" in l]
    assert len(lines) == 1 and lines[0].startswith("config error: anchor.device=-1: GPU 0 would hold"), p.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_a_config_json_without_a_key_the_plan_reads():
    """Multi-head attention without `num_key_value_heads`: as many key/value heads as heads; a
    multimodal config's text model under `text_config`; any other key missing is one ConfigError."""
    mha = {k: v for k, v in QWEN_1P5B.items() if k != "num_key_value_heads"}
    assert Shape.from_hf(mha).num_key_value_heads == 12
    assert Shape.from_hf({"text_config": QWEN_1P5B, "tie_word_embeddings": False}) == Shape.from_hf(
        {**QWEN_1P5B, "tie_word_embeddings": True})   # the text model's own key wins
    with pytest.raises(ConfigError, match="lacks intermediate_size"):
        Shape.from_hf({k: v for k, v in QWEN_1P5B.items() if k != "intermediate_size"})
