"""What DeepSpeed's bf16 does to the stage modules it is given: the weights become bf16, the rotary
embedding's inverse frequencies stay fp32 (DeepSpeed 0.19.8 casts parameters, not buffers), so
positions are rotated at fp32 resolution as in HF's bf16 models."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, TINY

SCRIPT = """
import json, os, sys
import torch
from ds_twocircuit.config import load_config
from ds_twocircuit.model.pipe import Decoder
from ds_twocircuit.pipeline.engine import build_pipeline, init_distributed
run = load_config(sys.argv[1], ["model.layers_per_stage=[8]"], world_size=1)
run.ds["bf16"] = {"enabled": True}
init_distributed(60)
p = build_pipeline(sys.argv[2], run.tc, run.ds)
decoders = [m for m in p.pipe.modules() if isinstance(m, Decoder)]
print("RESULT " + json.dumps({"weights": sorted({str(q.dtype) for q in p.pipe.parameters()}),
                              "inv_freq": sorted({str(m.rotary.inv_freq.dtype) for m in decoders}),
                              "decoders": len(decoders)}), flush=True)
os._exit(0)
"""


@pytest.mark.dist
def test_rotary_frequencies_stay_fp32_under_bf16(tiny_model):
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29731", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(TINY), str(tiny_model)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads(line[len("RESULT "):])
    assert res == {"weights": ["torch.bfloat16"], "inv_freq": ["torch.float32"], "decoders": 8}, res
