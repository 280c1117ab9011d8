"""launch/projection.py's generation table: sync is gen + train + sync, async sync + max(gen, train)."""
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "launch"))
import projection  # noqa: E402


def cells(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def test_async_hides_the_shorter_of_generation_and_training():
    a = projection.parse(["--layout", "full", "--tokens", "1024", "--sampler-gpus", "2"])
    rows = cells(projection.generation_table(a))
    assert len(rows) == 2 * len(projection.CODECS) * 2
    for link, codec, rate, gen, train, sync, step_sync, step_async, gain in rows:
        gen, train, sync = float(gen), float(train), float(sync)
        assert abs(float(step_sync) - (gen + train + sync)) <= 1.5
        assert abs(float(step_async) - (sync + max(gen, train))) <= 1.0
        assert float(gain[:-1]) >= 1.0
    assert abs(float(rows[0][3]) - a.resp / (a.gen_tokens_per_s * 2)) < 0.5      # two sampler GPUs
