"""Crash-safe checkpoints (run/checkpoint.py): each rank seals (fsyncs and hashes) the files it wrote
before `latest` names them, verified before resume; older sealed ones pruned."""
import json
import os

import pytest
import torch

from ds_twocircuit.run import checkpoint, files
from ds_twocircuit.run.checkpoint import CheckpointError, point_latest, prune, recording_writes, seal, verify_latest


def saved(tmp_path, tag="step4"):
    """A checkpoint as DeepSpeed lays one out, written by two ranks, each sealing its own files,
    named by `latest`."""
    d = tmp_path / tag
    (d / "zero").mkdir(parents=True)
    (d / "layer_01-model_states.pt").write_bytes(b"w" * 5000)
    (d / "mp_rank_00_model_states.pt").write_bytes(b"s" * 300)
    (d / "zero" / "optim_states.pt").write_bytes(b"o" * 700)
    seal(d, "rank0", [d / "layer_01-model_states.pt", d / "mp_rank_00_model_states.pt"])
    seal(d, "rank1", [d / "zero" / "optim_states.pt"])
    point_latest(tmp_path, tag)
    return d


def test_sealed_checkpoint_verifies_and_names_its_tag(tmp_path):
    d = saved(tmp_path)
    manifest = json.loads((d / "manifest.rank0.json").read_text())
    assert sorted(manifest["files"]) == ["layer_01-model_states.pt", "mp_rank_00_model_states.pt"]
    assert list(json.loads((d / "manifest.rank1.json").read_text())["files"]) == ["zero/optim_states.pt"]
    assert verify_latest(tmp_path).startswith("step4 (2 manifest(s) verified)")
    assert (tmp_path / "latest").read_text() == "step4" and not list(tmp_path.glob(".latest.tmp*"))


def test_files_are_on_disk_before_their_manifest_and_latest(tmp_path, monkeypatch):
    """fsync order: each file a rank wrote, then its manifest, then the directories holding them;
    `latest` itself and the checkpoints directory (the rename) last."""
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    d = saved(tmp_path)
    names = [os.path.relpath(p, tmp_path) for p in synced]
    rank0 = names.index("step4/layer_01-model_states.pt")
    assert names[rank0 + 1] == "step4/mp_rank_00_model_states.pt"
    assert names[rank0 + 2].startswith("step4/.manifest.rank0.json.tmp") and names[rank0 + 3] == "step4"
    assert names[-2].startswith(".latest.tmp") and names[-1] == "."
    assert "step4/zero" in names and "step4/zero/optim_states.pt" in names


def test_recording_writes_sees_every_file_deepspeeds_engine_saves(tmp_path):
    """DeepSpeed's own checkpoint engine, called as its save paths call it (positional and keyword):
    each path recorded, the engine's method restored after."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    eng = TorchCheckpointEngine()
    with recording_writes(eng) as written:
        eng.save({"a": torch.ones(2)}, str(tmp_path / "one.pt"))
        eng.save(state_dict={"b": torch.zeros(3)}, path=str(tmp_path / "two.pt"))
    assert written == [tmp_path / "one.pt", tmp_path / "two.pt"] and "save" not in vars(eng)
    assert torch.equal(torch.load(tmp_path / "two.pt")["b"], torch.zeros(3))


def test_prune_keeps_the_newest_sealed_and_never_latest_or_a_newer_one(tmp_path):
    for step in (10, 20, 30, 40, 50):
        saved(tmp_path, f"step{step}")
    (tmp_path / "step60").mkdir()                               # a save under way: no manifest yet
    (tmp_path / "step5").mkdir()                                # written before sealing existed
    assert prune(tmp_path, 0, {"step50"}) == []                 # keep = 0: every one kept
    assert prune(tmp_path, 2, {"step50"}) == ["step10", "step20", "step30"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step40", "step5", "step50", "step60"]
    # `latest` read before it moved (another node): the previous tag protected, nothing newer removed
    saved(tmp_path, "step70")
    assert prune(tmp_path, 1, {"step50"}) == ["step40"]
    assert prune(tmp_path, 1, {"step70"}) == ["step50"]
    assert verify_latest(tmp_path).startswith("step70")


@pytest.mark.parametrize("damage, says", [
    (lambda f: f.write_bytes(f.read_bytes()[:100]), "truncated or altered: 100 bytes, sealed at 5000"),
    (lambda f: f.write_bytes(b"x" + f.read_bytes()[1:]), "is corrupt"),
    (lambda f: f.unlink(), "is missing"),
])
def test_damaged_file_is_refused_with_its_name(tmp_path, damage, says):
    d = saved(tmp_path)
    damage(d / "layer_01-model_states.pt")
    with pytest.raises(CheckpointError, match=f"layer_01-model_states.pt {says}" if "missing" in says else says) as e:
        verify_latest(tmp_path)
    assert str(d / "layer_01-model_states.pt") in str(e.value)


def test_latest_and_manifest_faults(tmp_path):
    with pytest.raises(CheckpointError, match="missing or empty"):
        verify_latest(tmp_path)
    d = saved(tmp_path)
    (tmp_path / "latest").write_text("")                      # an in-place write cut short
    with pytest.raises(CheckpointError, match="missing or empty"):
        verify_latest(tmp_path)
    (tmp_path / "latest").write_text("step9")
    with pytest.raises(CheckpointError, match="step9 does not exist"):
        verify_latest(tmp_path)
    (tmp_path / "latest").write_text("step4")
    (d / "manifest.rank1.json").write_text('{"tag": "step4", "fi')
    with pytest.raises(CheckpointError, match="manifest.rank1.json: unreadable manifest"):
        verify_latest(tmp_path)
    for m in d.glob("manifest.*"):                            # written before checkpoints were sealed
        m.unlink()
    assert "not verified" in verify_latest(tmp_path)
