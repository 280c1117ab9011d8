#!/usr/bin/env bash
# The long-run campaign: dense, frontier_wide.json and prf95.json with the anchor every step (c = K = 1),
# from one fixed starting model, the same batch and savings for all, one run at a time (2 cores).
#   notebooks/campaign.sh COMMIT START_DIR STEPS NAME [NAME ...]   (NAME: dense_s0, frontier_s1, prf95_s0,
#                                                                  frontier_rc_s0: with the rollout correction,
#                                                                  frontier_k1rc_s0: a step ahead with it, ...)
# Every run of a campaign runs the code of COMMIT, from a git worktree of it (so the checkout can move
# on meanwhile, and each run's provenance.json records COMMIT, clean). Runs go under runs/campaign/NAME;
# a finished one (its eval.jsonl has step STEPS) is not run again, an interrupted one resumes from its
# last checkpoint. Each finished run's small files (config, provenance, evaluations with per-prompt
# scores, the metrics rows gzipped) are copied to notebooks/campaign/NAME, to be committed as it
# lands: a machine may not keep runs/. The seed s sets the data order, the sampling and the codec's key.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD commit=$(git rev-parse "$1") start=$(realpath "$2") steps=$3
shift 3
tree=$root/runs/campaign/.code-${commit:0:8}
[ -d "$tree" ] || git worktree add --detach "$tree" "$commit" > /dev/null || exit 1
common=(model.path="$start" grpo.prompts_per_step=16 grpo.group_size=8 grpo.kl_coef=0 grpo.skip_zero_advantage=true
        data.eval_size=2048 train.steps="$steps" train.eval_every=25 train.save_every=50 train.probe_every=10 log.wandb=false)
declare -A RECIPES=(
  [dense]="ds_configs/dense.json"
  [frontier]="ds_configs/frontier_wide.json"
  [prf95]="ds_configs/prf95.json"
  [frontier_rc]="ds_configs/frontier_wide.json"
  [prf95_rc]="ds_configs/prf95.json"
  [frontier_k1]="ds_configs/frontier_wide.json"
  [frontier_k1rc]="ds_configs/frontier_wide.json"
  [frontier_k2]="ds_configs/frontier_wide.json"
  [frontier_k2rc]="ds_configs/frontier_wide.json"
  [prf95_k1rc]="ds_configs/prf95.json"
)
# a recipe's own overrides: the rollout correction on, the sampler a step ahead, micro-batches never
# trimmed (what the campaign's commit did, so that these runs differ from its runs by those alone:
# notebooks/LOG.md)
declare -A EXTRA=(
  [frontier_rc]="grpo.rollout_correction.enabled=true train.trim_micro_batches=never"
  [prf95_rc]="grpo.rollout_correction.enabled=true train.trim_micro_batches=never"
  [frontier_k1]="rollout.staleness=1 train.trim_micro_batches=never"
  [frontier_k1rc]="rollout.staleness=1 grpo.rollout_correction.enabled=true train.trim_micro_batches=never"
  [frontier_k2]="rollout.staleness=2 train.trim_micro_batches=never"
  [frontier_k2rc]="rollout.staleness=2 grpo.rollout_correction.enabled=true train.trim_micro_batches=never"
  [prf95_k1rc]="rollout.staleness=1 grpo.rollout_correction.enabled=true train.trim_micro_batches=never"
)
for name in "$@"; do
  recipe=${name%_s*} seed=${name##*_s}
  cfg=${RECIPES[$recipe]:?unknown recipe in $name}
  dir=$root/runs/campaign/$name
  if grep -q "\"step\": $steps," "$dir/eval.jsonl" 2>/dev/null; then echo "[campaign] $name: done"; continue; fi
  read -ra extra <<< "${EXTRA[$recipe]:-}"
  codec_seed=(codec.seed="$seed")
  [ "$recipe" = dense ] && codec_seed=()    # the dense codec reads no key
  resume=()
  # a run stopped before its first checkpoint starts over (commits that know --overwrite refuse a dir holding a run)
  [ -d "$dir" ] && grep -q -- "--overwrite" "$tree/launch/train.py" && resume=(--overwrite)
  [ -f "$dir/checkpoints/latest" ] && resume=(--resume)
  echo "[campaign] $name: $cfg seed $seed from $start, $steps steps, code ${commit:0:8} ($(date -u +%H:%M))"
  (cd "$tree" && PYTHONPATH="$tree" deepspeed --num_gpus 8 --master_port "${MASTER_PORT:-29500}" launch/train.py \
     --ds-config "$cfg" --run-dir "$dir" "${resume[@]}" "${common[@]}" train.seed="$seed" "${codec_seed[@]}" "${extra[@]}") \
     > "$dir.log" 2>&1 || { echo "[campaign] $name failed: $dir.log"; exit 1; }
  keep=$root/notebooks/campaign/$name
  mkdir -p "$keep"
  cp "$dir/config.yaml" "$dir/provenance.json" "$dir/eval.jsonl" "$keep/"
  gzip -c "$dir/metrics.jsonl" > "$keep/metrics.jsonl.gz"
  echo "[campaign] $name: finished ($(date -u +%H:%M)); kept in $keep"
done
