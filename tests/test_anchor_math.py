"""The anchor's pure pieces: sign packing, the correction's closed forms, the staleness contract."""
import json
import math

import pytest
import torch

from ds_twocircuit.anchor.forecast import forecast, fires_replaying, forecast_steps, is_fire_step, weights_step
from ds_twocircuit.anchor.sign import (agreement_count, corrected_gradient, pack_signs, signs_of, unpack_bits,
                                       zero_runs)


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 1000, 12345])
def test_pack_round_trip_and_size(numel):
    m = torch.randn(numel)
    buf = pack_signs(m)
    assert len(buf) == math.ceil(numel / 8)
    assert torch.equal(unpack_bits(buf, numel), m > 0)
    with pytest.raises(ValueError, match="expected"):
        unpack_bits(buf + b"\0", numel)


def test_correction_closed_forms():
    g = torch.tensor([2.0, -3.0, 0.5, -0.25, 0.0])
    s = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0])
    out = corrected_gradient(g, s, alpha=0.25)
    assert out.tolist() == [2.0, -3.0, -0.25, 0.125, 0.0]        # agree: g; disagree: (2α−1)g
    ref = 0.25 * g + 0.75 * g.abs() * s
    torch.testing.assert_close(out, ref)
    assert corrected_gradient(g, s, alpha=1.0).tolist() == g.tolist()
    agree, signed = agreement_count(g, s.to(torch.int8))
    assert (int(agree), int(signed)) == (3, 5)                     # 2, −3 and the zero agree


def test_a_zero_of_m_has_no_sign_and_leaves_the_gradient_as_it_is():
    """M = 0 (a coordinate the replay never touched) travels as a run beside the bits and reads as
    s = 0: the gradient there is left as it is (one bit alone would read it as −1 and scale it by
    2α − 1), and it is left out of the agreement."""
    m = torch.tensor([0.5, 0.0, 0.0, -0.2, 0.0, 0.3, 0.0])
    runs = zero_runs(m)
    assert runs.tolist() == [[1, 2], [4, 1], [6, 1]]
    s = signs_of(unpack_bits(pack_signs(m), m.numel()), runs)
    assert s.tolist() == [1, 0, 0, -1, 0, 1, 0]
    g = torch.tensor([-1.0, 2.0, -3.0, 4.0, 5.0, 6.0, -7.0])
    assert corrected_gradient(g, s, 0.25).tolist() == [0.5, 2.0, -3.0, -2.0, 5.0, 6.0, -7.0]
    agree, signed = agreement_count(g, s)
    assert (int(agree), int(signed)) == (1, 3)
    assert zero_runs(torch.randn(100)).shape == (0, 2) and zero_runs(torch.zeros(3)).tolist() == [[0, 3]]


def test_formula_on_random_values():
    g, s = torch.randn(10000), torch.where(torch.randn(10000) > 0, 1.0, -1.0)
    for a in (0.0, 0.25, 0.5):
        torch.testing.assert_close(corrected_gradient(g, s, a), a * g + (1 - a) * g.abs() * s)


def test_agreeing_sign_leaves_adamw_bitwise_unchanged():
    torch.manual_seed(0)
    w1 = torch.nn.Parameter(torch.randn(300))
    w2 = torch.nn.Parameter(w1.detach().clone())
    o1, o2 = torch.optim.AdamW([w1], lr=1e-2), torch.optim.AdamW([w2], lr=1e-2)
    for _ in range(10):
        g = torch.randn(300)
        w1.grad, w2.grad = g.clone(), corrected_gradient(g.clone(), torch.sign(g), 0.25)
        o1.step()
        o2.step()
    assert torch.equal(w1, w2)


def test_staleness_contract():
    assert [t for t in range(61) if is_fire_step(t, 20)] == [0, 20, 40, 60]
    assert [weights_step(t, 20) for t in (0, 20, 40, 60)] == [0, 0, 20, 40]
    assert forecast_steps(0, 20, 20) == (0, None)
    assert forecast_steps(20, 20, 20) == (0, None)
    assert forecast_steps(40, 20, 20) == (20, 0)
    assert forecast_steps(60, 20, 20) == (40, 20)
    assert forecast_steps(60, 10, 20) == (50, 30)


def test_shipping_schedule_matches_the_contract():
    """The trainer ships θ(t) for exactly the fires whose weights step is t, each fire once."""
    for c, K, steps in [(20, 20, 100), (20, 10, 100), (10, 20, 100), (1, 1, 10), (2, 0, 9), (3, 7, 40)]:
        shipped = {t: fires_replaying(t, c, K, steps) for t in range(steps)}
        fires = sorted(f for fs in shipped.values() for f in fs)
        assert fires == list(range(0, steps, c)), (c, K)
        for t, fs in shipped.items():
            assert all(weights_step(f, K) == t for f in fs)
    assert fires_replaying(0, 20, 20, 100) == [0, 20]
    assert fires_replaying(20, 20, 20, 100) == [40]
    assert fires_replaying(80, 20, 20, 100) == []          # fire 100 is past the run
    assert fires_replaying(5, 10, 5, 100) == [10]
    assert fires_replaying(0, 10, 5, 100) == [0]


def test_forecast_secant():
    new, old = {"w": torch.tensor([3.0, 1.0])}, {"w": torch.tensor([1.0, 1.0])}
    assert forecast(new, old, 20, 20)["w"].tolist() == [5.0, 1.0]
    assert forecast(new, old, 10, 20)["w"].tolist() == [4.0, 1.0]
    assert forecast(new, None, 20, 20)["w"].tolist() == [3.0, 1.0]
    with pytest.raises(ValueError):
        forecast(new, {"v": torch.zeros(2)}, 20, 20)


# ---- the mailbox's files ------------------------------------------------------------------
from safetensors.torch import save_file  # noqa: E402

from ds_twocircuit.anchor.mailbox import (MailboxError, batch_path, metadata, pending_requests,  # noqa: E402
                                          published_fires, read_pin, read_sign, read_state, read_tensors, rewind,
                                          sign_path, state_path, steps_in, theta_path, write_pin, write_request,
                                          write_sign, write_state, write_tensors)

SHAPES = {"a.weight": (3, 5), "b.bias": (7,)}


def test_tensor_round_trip_and_rejections(tmp_path):
    t = {"b.bias": torch.randn(7), "a.weight": torch.randn(3, 5)}      # not sorted: the written order is kept
    p = tmp_path / "theta" / "stage0.safetensors"
    write_tensors(p, 20, t)
    got = read_tensors(p, 20, {"b.bias": (7,), "a.weight": (3, 5)})
    assert list(got) == list(t) and all(torch.equal(got[n], t[n]) for n in t)
    assert metadata(p)["format"] == "ds_twocircuit.mailbox" and list(p.parent.iterdir()) == [p]   # one file
    with pytest.raises(MailboxError, match="step 20, expected 40"):
        read_tensors(p, 40)
    with pytest.raises(MailboxError, match="differ"):
        read_tensors(p, 20, {"a.weight": (3, 5)})
    data = p.read_bytes()
    p.write_bytes(data[:-3])
    with pytest.raises(MailboxError, match="corrupt or truncated"):
        read_tensors(p, 20)
    p.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(MailboxError, match="sha256"):
        read_tensors(p, 20)
    p.write_bytes(b"{not safetensors")
    with pytest.raises(MailboxError, match="corrupt or truncated"):
        read_tensors(p, 20)
    save_file({"w": torch.zeros(2)}, str(p))                       # safetensors, but not ours
    with pytest.raises(MailboxError, match="not a mailbox file"):
        read_tensors(p, 20)
    with pytest.raises(MailboxError, match="missing"):
        read_tensors(tmp_path / "nope.safetensors", 20)
    assert not list(p.parent.glob(".*tmp*"))


def test_a_state_that_does_not_check_out_falls_back_to_the_previous_fire(tmp_path):
    """The anchor's state of fire 8 truncated (a copy cut short, a disk that lost the write): a
    restart must resume from fire 4's state, not crash on the bad one (a crash here is a crash on
    every restart: the CI failure of 2026-12-01). Only 2 states are kept."""
    m = {f: {"M.a": torch.full((3,), float(f))} for f in (0, 4, 8)}
    write_state(tmp_path, 0, m[0])
    write_state(tmp_path, 4, m[4])
    write_state(tmp_path, 8, m[8])
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == [f"step{f:08d}.safetensors" for f in (4, 8)]
    fire, got, rejected = read_state(tmp_path)
    assert fire == 8 and torch.equal(got["M.a"], m[8]["M.a"]) and rejected == []
    path = state_path(tmp_path, 8)
    path.write_bytes(path.read_bytes()[:-4])
    fire, got, rejected = read_state(tmp_path)
    assert fire == 4 and torch.equal(got["M.a"], m[4]["M.a"]) and "truncated" in rejected[0]
    state_path(tmp_path, 4).write_bytes(b"garbage")                # and the older one corrupt too
    assert read_state(tmp_path)[0] == -1


def test_sign_file_size_and_rejections(tmp_path):
    numel = sum(math.prod(s) for s in SHAPES.values())
    bits = pack_signs(torch.randn(numel))
    p = tmp_path / "stage1.safetensors"
    write_sign(p, 40, 1, SHAPES, bits, numel)
    assert 0 < p.stat().st_size - math.ceil(numel / 8) < 1024      # the bits and a header under 1 KiB
    step, got, n, runs = read_sign(p, 1, SHAPES)
    assert (step, got, n, runs.shape) == (40, bits, numel, (0, 2))
    size = p.stat().st_size
    write_sign(p, 40, 1, SHAPES, bits, numel, torch.tensor([[2, 3]]))    # zero runs ride beside the bits
    assert read_sign(p, 1, SHAPES)[3].tolist() == [[2, 3]] and p.stat().st_size > size
    write_sign(p, 40, 1, SHAPES, bits, numel, torch.tensor([[numel - 1, 2]]))
    with pytest.raises(MailboxError, match="zero runs outside"):
        read_sign(p, 1, SHAPES)
    write_sign(p, 40, 1, SHAPES, bits, numel)
    with pytest.raises(MailboxError, match="stale"):
        read_sign(p, 1, SHAPES, newer_than=40)
    with pytest.raises(MailboxError, match="stage 1"):
        read_sign(p, 2, SHAPES)
    with pytest.raises(MailboxError, match="layout"):
        read_sign(p, 1, {"a.weight": (5, 3), "b.bias": (7,)})
    raw = p.read_bytes()
    p.write_bytes(raw[:-1])
    with pytest.raises(MailboxError, match="corrupt or truncated"):
        read_sign(p, 1, SHAPES)
    p.write_bytes(raw[:50])
    with pytest.raises(MailboxError, match="corrupt or truncated"):
        read_sign(p, 1, SHAPES)
    p.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    with pytest.raises(MailboxError, match="sha256"):
        read_sign(p, 1, SHAPES)
    write_sign(p, 40, 1, SHAPES, bits[:-1], numel)                 # a payload short of P bits
    with pytest.raises(MailboxError, match="truncated payload"):
        read_sign(p, 1, SHAPES)
    write_tensors(p, 40, {"bits": torch.zeros(2, dtype=torch.uint8)})
    with pytest.raises(MailboxError, match="not a sign file"):
        read_sign(p, 1, SHAPES)


def _mailbox(root, fires=(0, 2, 4, 6), K=2):
    """Requests, shipped inputs, signs and states of `fires` (weights step f − K), as a run leaves them."""
    shapes = {"w": (4,)}
    for f in fires:
        s = weights_step(f, K)
        write_request(root, {"fire": f, "weights_step": s, "older_step": None, "stages": 1, "every": 2,
                             "staleness": K, "kl_coef": 0.0})
        write_tensors(theta_path(root, s, 0), s, {"w": torch.full((4,), float(s))})
        write_tensors(batch_path(root, s), s, {"ids_NT": torch.zeros(1, 2)})
        write_sign(sign_path(root, f, 0), f, 0, shapes, pack_signs(torch.randn(4)), 4)
        write_state(root, f, {"w": torch.full((4,), float(f))})


def test_rewind_removes_exactly_what_lies_past_the_checkpoint(tmp_path):
    """A checkpoint after 3 steps holding fire 2 (c = K = 2): fire 4 replays θ(2), shipped before the
    checkpoint, so its request and inputs stay (the resumed trainer will not ship them again); fire
    6 replays θ(4), shipped after it: request and inputs go. Every sign and state after fire 2 goes."""
    write_pin(tmp_path, 2, 3)                                    # the checkpoint pinned fire 2
    _mailbox(tmp_path)
    assert steps_in(tmp_path / "state", ".safetensors") == [2, 4, 6]   # fire 0's: before the pin, not newest 2
    gone = rewind(tmp_path, 2, 3)
    assert gone == {"requests": 1, "inputs": 1, "signs": 2, "states": 2}
    assert [r["fire"] for r in pending_requests(tmp_path, -1)] == [0, 2, 4]
    assert steps_in(tmp_path / "theta") == [0, 2] and steps_in(tmp_path / "batch", ".safetensors") == [0, 2]
    assert published_fires(tmp_path) == [0, 2]
    fire, state, _ = read_state(tmp_path)
    assert fire == 2 and torch.equal(state["w"], torch.full((4,), 2.0))
    assert read_pin(tmp_path) == {"fire": 2, "step": 3}
    assert json.loads((tmp_path / "rewind.json").read_text())["fire"] == 2


def test_states_are_kept_from_the_pin_on_and_a_fresh_run_rewinds_to_nothing(tmp_path):
    _mailbox(tmp_path, fires=(0, 2, 4, 6, 8))
    assert steps_in(tmp_path / "state", ".safetensors") == [6, 8]      # no checkpoint: the newest two
    write_pin(tmp_path, 2, 3)
    write_state(tmp_path, 10, {"w": torch.zeros(4)})
    assert steps_in(tmp_path / "state", ".safetensors") == [6, 8, 10]  # nothing older than the pin left to keep
    rewind(tmp_path, -1, 0, pin=False)
    assert not (tmp_path / "pin.json").exists() and read_pin(tmp_path)["fire"] == -1
    assert published_fires(tmp_path) == [] and read_state(tmp_path)[0] == -1
    assert pending_requests(tmp_path, -1) == [] and steps_in(tmp_path / "theta") == []


# ---- θ as lossless deltas in the mailbox ---------------------------------------------------
from ds_twocircuit.anchor.forecast import replay_groups  # noqa: E402
from ds_twocircuit.anchor.mailbox import delta_path, prune, read_theta, theta_base, write_delta  # noqa: E402
from ds_twocircuit.sync.delta import encode_all  # noqa: E402


def _ship_chain(root, steps, keyframes, dtype=torch.bfloat16):
    """θ(s) = a slowly moving bf16 tensor pair, shipped at `steps`: whole at `keyframes`, else as a
    delta against the previous shipped step. → step → the tensors shipped."""
    g = torch.Generator().manual_seed(0)
    w = {"b.bias": torch.randn(7, generator=g), "a.weight": torch.randn(3, 5, generator=g)}   # not sorted:
    # safetensors hands tensors back by name, a delta lists them in the stage's order
    shipped, prev = {}, None
    for s in steps:
        w = {n: x + 1e-3 * torch.randn(x.shape, generator=g) for n, x in w.items()}
        now = {n: x.to(dtype) for n, x in w.items()}
        if s in keyframes:
            write_tensors(theta_path(root, s, 0), s, now)
        else:
            blob, _ = encode_all([shipped[prev][n] for n in now], list(now.values()))
            write_delta(delta_path(root, s, 0), s, prev, blob, {n: tuple(x.shape) for n, x in now.items()}, dtype)
        shipped[s], prev = now, s
    return shipped


def test_theta_deltas_rebuild_bitwise_through_their_chain(tmp_path):
    shipped = _ship_chain(tmp_path, [0, 2, 4, 6, 8], keyframes={0, 6})
    assert [theta_base(tmp_path, s) for s in (0, 2, 4, 6, 8)] == [None, 0, 2, None, 6]
    for s, want in shipped.items():
        got = read_theta(tmp_path, s, 0, SHAPES)
        assert all(torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)) for n in want), s
    # from a step the reader holds, only the deltas after it are read
    delta_path(tmp_path, 2, 0).write_bytes(b"gone")                # would fail if read
    held = {2: shipped[2]}
    assert torch.equal(read_theta(tmp_path, 4, 0, SHAPES, held)["b.bias"], shipped[4]["b.bias"])
    with pytest.raises(MailboxError, match="corrupt or truncated"):
        read_theta(tmp_path, 4, 0, SHAPES)
    with pytest.raises(MailboxError, match="differ"):
        read_theta(tmp_path, 8, 0, {"a.weight": (3, 5)})


def test_prune_keeps_the_chain_a_kept_step_needs(tmp_path):
    _ship_chain(tmp_path, [0, 2, 4, 6, 8, 10], keyframes={0, 6})
    for s in (0, 2, 4, 6, 8, 10):
        write_tensors(batch_path(tmp_path, s), s, {"ids_NT": torch.zeros(1, 2)})
    prune(tmp_path, [(4, math.inf)], signs_before=0, states_before=0, pinned=-1)   # θ(4) is a delta on θ(2) on θ(0)
    assert steps_in(tmp_path / "theta") == [0, 2, 4, 6, 8, 10]
    assert steps_in(tmp_path / "batch", ".safetensors") == [4, 6, 8, 10]
    prune(tmp_path, [(8, math.inf)], signs_before=0, states_before=0, pinned=-1)   # θ(8) needs θ(6), a keyframe
    assert steps_in(tmp_path / "theta") == [6, 8, 10]
    assert read_theta(tmp_path, 10, 0, SHAPES).keys() == SHAPES.keys()


def test_between_the_pin_and_the_pending_fires_nothing_is_kept(tmp_path):
    """c = K = 1, a θ shipped every step (keyframes at 0, 6, 12, 18), a state per fire; the trainer
    holds fire 17 and its checkpoint after 5 steps pinned fire 4: pending fires read θ from step
    15 on (held's weights step 16, minus one cadence for the forecast), a rewind to the pin reads
    steps [2, 5) (fire 4's weights step 3, minus one) and fire 4's state. Steps 5–11 go, and every
    state between the pin and the held fire but the newest two; a rewind to the pin then finds what
    the resumed run reads: fire 4's state and the newest θ shipped before step 5."""
    shipped = _ship_chain(tmp_path, range(21), keyframes={0, 6, 12, 18})
    for s in range(21):
        write_tensors(batch_path(tmp_path, s), s, {"ids_NT": torch.zeros(1, 2)})
        write_tensors(state_path(tmp_path, s), s, {"w": torch.full((4,), float(s))})
    prune(tmp_path, [(15, math.inf), (2, 5)], signs_before=4, states_before=17, pinned=4)
    assert steps_in(tmp_path / "theta") == [0, 1, 2, 3, 4, 12, 13, 14, 15, 16, 17, 18, 19, 20]   # chains to 0 and 12
    assert steps_in(tmp_path / "batch", ".safetensors") == [2, 3, 4, 15, 16, 17, 18, 19, 20]
    assert steps_in(tmp_path / "state", ".safetensors") == [4, 17, 18, 19, 20]
    rewind(tmp_path, 4, 5)
    fire, state, _ = read_state(tmp_path)
    assert fire == 4 and torch.equal(state["w"], torch.full((4,), 4.0))
    got = read_theta(tmp_path, 4, 0, SHAPES)
    assert all(torch.equal(got[n].view(torch.int16), shipped[4][n].view(torch.int16)) for n in SHAPES)


def test_replay_groups_are_a_keyed_share():
    assert replay_groups(32, 1.0, 0, 5) == list(range(32))
    a = replay_groups(32, 0.25, 0, 5)
    assert len(a) == 8 and a == sorted(set(a)) and a == replay_groups(32, 0.25, 0, 5)
    assert a != replay_groups(32, 0.25, 0, 6) and a != replay_groups(32, 0.25, 1, 5)
    assert replay_groups(3, 0.01, 0, 0) != [] and len(replay_groups(3, 0.01, 0, 0)) == 1


def test_memory_over_two_fires_is_the_closed_form():
    """M_2 = β·(1 − β)·G_1 + (1 − β)·G_2, bit for bit as the update computes it. With G_2 = −G_1/2
    and β = 0.75, M_2's sign is G_1's: the memory, not the last gradient, decides it (an update
    that forgets M, or swaps the two coefficients, gives the opposite sign)."""
    from ds_twocircuit.anchor.memory import update_memory
    b = 0.75
    g1 = torch.randn(100, generator=torch.Generator().manual_seed(0))
    g2 = -0.5 * g1
    m1 = update_memory({}, {"w": g1}, b)
    m2 = update_memory(m1, {"w": g2}, b)
    assert torch.equal(m1["w"], (1 - b) * g1)
    assert torch.equal(m2["w"], b * ((1 - b) * g1) + (1 - b) * g2)
    torch.testing.assert_close(m2["w"], (1 - b) * (b * g1 + g2))
    assert torch.equal(m2["w"] > 0, g1 > 0)
    assert torch.equal(m1["w"], (1 - b) * g1)        # pure: the old M is left as it was
