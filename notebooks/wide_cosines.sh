#!/usr/bin/env bash
# Short runs of the wide model for what needs no learning control: the gradient cosine (probe every
# step), the step-1 gap and the bytes per step of each codec at d = 384; results under runs/wide_cos/.
cd "$(dirname "$0")/.."
. .venv/bin/activate
W="model.embedded=wide train.steps=6 train.probe_every=1 train.eval_every=100 train.save_every=0 log.wandb=false"
for spec in "rot4|ds_configs/rotated.json codec.bwd_coords=240" "rot2|ds_configs/rotated.json codec.fwd_bits=2 codec.bwd_coords=240" "prf5|ds_configs/prf95.json anchor.enabled=false"; do
  name=${spec%%|*}; rest=${spec#*|}; cfg=${rest%% *}; ov=${rest#* }
  dir=runs/wide_cos/$name; rm -rf $dir; mkdir -p $dir
  echo "$name $(date +%T) start"
  deepspeed --num_gpus 8 --master_port 29633 launch/train.py --ds-config $cfg --run-dir $dir $W $ov > $dir/stdout.log 2>&1
  echo "$name $(date +%T) rc=$?"
done
