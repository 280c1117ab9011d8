#!/bin/bash
# Runs the learning-table/search experiments one after another (one heavy job at a time on 2 cores).
# usage: queue.sh NAME "overrides..." [NAME "overrides..."]...   → runs/search/NAME, log in runs/search/NAME.log
cd "$(dirname "$0")/../.."
while [ $# -gt 1 ]; do
  name=$1; ov=$2; shift 2
  [ -f runs/search/$name/eval.jsonl ] && grep -q '"step": 100' runs/search/$name/eval.jsonl && continue
  rm -rf runs/search/$name; mkdir -p runs/search
  start=$(date +%s)
  .venv/bin/deepspeed --num_gpus 8 --master_port $((29500 + RANDOM % 1000)) launch/train.py \
      --ds-config ${CFG:-ds_configs/prf95.json} --run-dir runs/search/$name log.wandb=false $ov > runs/search/$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - start ))s $(tr '\n' ' ' < runs/search/$name/eval.jsonl | grep -o '"acc": [0-9.]*' | tr '\n' ' ')" >> runs/search/DONE
done
