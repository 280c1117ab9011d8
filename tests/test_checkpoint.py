"""Crash-safe checkpoints (run/checkpoint.py): sealed before `latest` names them, verified before resume."""
import json

import pytest

from ds_twocircuit.run.checkpoint import CheckpointError, point_latest, seal, verify_latest


def saved(tmp_path, tag="step4"):
    """A checkpoint as DeepSpeed lays one out, sealed by one node and named by `latest`."""
    d = tmp_path / tag
    (d / "zero").mkdir(parents=True)
    (d / "layer_01-model_states.pt").write_bytes(b"w" * 5000)
    (d / "mp_rank_00_model_states.pt").write_bytes(b"s" * 300)
    (d / "zero" / "optim_states.pt").write_bytes(b"o" * 700)
    seal(d, "node0")
    point_latest(tmp_path, tag)
    return d


def test_sealed_checkpoint_verifies_and_names_its_tag(tmp_path):
    d = saved(tmp_path)
    manifest = json.loads((d / "manifest.node0.json").read_text())
    assert sorted(manifest["files"]) == ["layer_01-model_states.pt", "mp_rank_00_model_states.pt",
                                         "zero/optim_states.pt"]
    assert verify_latest(tmp_path).startswith("step4 (1 manifest(s) verified)")
    assert (tmp_path / "latest").read_text() == "step4" and not list(tmp_path.glob(".latest.tmp*"))


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
    (d / "manifest.node0.json").write_text('{"tag": "step4", "fi')
    with pytest.raises(CheckpointError, match="manifest.node0.json: unreadable manifest"):
        verify_latest(tmp_path)
    for m in d.glob("manifest.*"):                            # written before checkpoints were sealed
        m.unlink()
    assert "not verified" in verify_latest(tmp_path)
