cd "$(dirname "$0")"
. "${VENV:-../../.venv}/bin/activate"   # the project venv
export OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu MASTER_ADDR=127.0.0.1 MASTER_PORT=29731 WORLD_SIZE=2
for r in 0 1; do RANK=$r LOCAL_RANK=$r timeout 150 python carrier_experiment.py > /tmp/carrier_out$r.txt 2>&1 & done
wait
grep RESULT /tmp/carrier_out0.txt /tmp/carrier_out1.txt; tail -3 /tmp/carrier_out0.txt /tmp/carrier_out1.txt
