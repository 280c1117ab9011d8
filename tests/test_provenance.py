"""What a run was made from (run/provenance.py): the starting weights' digest, checked against a
SHA256SUMS where the model ships one, and one entry per launch."""
import hashlib
import json

import pytest
import torch

from ds_twocircuit.config.schema import ConfigError
from ds_twocircuit.run import provenance


def model_dir(tmp_path, files: dict[str, bytes], sums: bool = True):
    d = tmp_path / "model"
    d.mkdir()
    for name, data in files.items():
        (d / name).write_bytes(data)
    if sums:
        (d / "SHA256SUMS").write_text("".join(f"{hashlib.sha256(v).hexdigest()}  {k}\n" for k, v in files.items()))
    return d


def test_the_start_digest_is_sha256sum_of_the_weights_and_checked_against_the_list(tmp_path):
    d = model_dir(tmp_path, {"model.safetensors": b"weights", "config.json": b"{}"})
    start = provenance.start_of(str(d))
    assert start["weights_sha256"] == hashlib.sha256(b"weights").hexdigest() and start["checked_against_sha256sums"]
    (d / "model.safetensors").write_bytes(b"weightz")                 # a changed copy of the start
    with pytest.raises(ConfigError, match="model.safetensors: sha256 .* is not the"):
        provenance.start_of(str(d))


def test_shards_and_unlisted_and_empty_directories(tmp_path):
    shards = {"model-00001-of-00002.safetensors": b"a", "model-00002-of-00002.safetensors": b"b"}
    d = model_dir(tmp_path, shards, sums=False)
    start = provenance.start_of(str(d))
    per = [hashlib.sha256(v).hexdigest() for v in shards.values()]
    assert start["weights_sha256"] == hashlib.sha256("".join(per).encode()).hexdigest()
    assert not start["checked_against_sha256sums"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no weight files"):
        provenance.start_of(str(tmp_path / "empty"))


def test_a_fresh_run_starts_the_list_and_a_resume_appends(tmp_path):
    start = provenance.start_of(str(model_dir(tmp_path, {"model.safetensors": b"w"})))
    run = tmp_path / "run"
    run.mkdir()
    provenance.record(run, start, 0, 8)
    provenance.record(run, start, 6, 8)
    got = provenance.read(run)
    assert [e["step"] for e in got] == [0, 6] and got[0]["start"] == start and got[0]["machine"]["world_size"] == 8
    assert len(got[0]["commit"]) == 40 or got[0]["commit"] == "unknown"
    machine = got[0]["machine"]     # what tells two CPUs sold under one name apart
    assert machine["cpu_isa"] == torch.backends.cpu.get_cpu_capability() and machine["cpu_id"].startswith("family ")
    provenance.record(run, start, 0, 8)                             # a fresh run in the same directory
    assert [e["step"] for e in provenance.read(run)] == [0]
    assert json.loads((run / "provenance.json").read_text())["launches"][0]["start"]["weights_sha256"]
