"""How a pass's sequences become micro-batches (pipeline/layout.py, pipeline/passes.py): padded in
batch order, or sorted by length and trimmed, and the rule that picks one."""
import pytest
import torch

from ds_twocircuit.codec.boundary import build_codec
from ds_twocircuit.config.schema import CodecConfig
from ds_twocircuit.grpo.rollouts import Rollout
from ds_twocircuit.model.pipe import mask_from_span
from ds_twocircuit.pipeline.layout import SHAPE_MESSAGE, choose_layout, padded_layout, trimmed_layout
from ds_twocircuit.pipeline.passes import host_logprobs, micro_batches


def batch(prompt_N, resp_N, P: int = 8, T: int = 40, seed: int = 0) -> Rollout:
    """Left-padded prompts of `prompt_N` tokens in P columns, responses of `resp_N` tokens after them,
    right-padded to T; ids, log-probs and advantages seeded."""
    g = torch.Generator().manual_seed(seed)
    prompt_N, resp_N = torch.as_tensor(prompt_N), torch.as_tensor(resp_N)
    N = len(prompt_N)
    span = torch.stack([P - prompt_N, P + resp_N], 1)
    attn = mask_from_span(span, T)
    resp = torch.zeros(N, T - 1)
    for i in range(N):
        resp[i, P - 1:P - 1 + int(resp_N[i])] = 1.0
    return Rollout(ids_NT=torch.randint(1, 100, (N, T), generator=g) * attn, attn_NT=attn, resp_NT1=resp,
                   sampler_logp_NT1=-torch.rand(N, T - 1, generator=g) * resp, rewards_N=torch.zeros(N),
                   adv_N=torch.randn(N, generator=g), sample_id_N=torch.arange(N))


def spans(r: Rollout) -> torch.Tensor:
    from ds_twocircuit.model.pipe import span_from_mask
    return span_from_mask(r.attn_NT)


def test_padded_layout_is_the_batch_in_order():
    lay = padded_layout(10, 7, 4)
    assert lay.rows == [slice(0, 4), slice(4, 8), slice(8, 12)] and lay.cols == [(0, 7)] * 3
    assert lay.positions() == 70 and not lay.trimmed


def test_trimmed_layout_sorts_by_length_keeps_groups_and_covers_every_token():
    g = torch.Generator().manual_seed(1)
    N, G = 24, 4
    prompts = torch.randint(1, 9, (N // G,), generator=g).repeat_interleave(G)   # a group shares its prompt
    r = batch(prompts, torch.randint(1, 31, (N,), generator=g), P=8, T=40)
    lay = trimmed_layout(spans(r), 40, micro=8, group=G)
    order = torch.cat(lay.rows)
    assert sorted(order.tolist()) == list(range(N))                             # every row once
    groups = torch.cat([rows.view(-1, G) for rows in lay.rows])               # each micro-batch whole groups
    assert torch.equal(groups % G, torch.arange(G).expand_as(groups)) and (groups // G == groups[:, :1] // G).all()
    length = (spans(r)[:, 1] - spans(r)[:, 0]).view(-1, G).amax(1)[groups[:, 0] // G]
    assert torch.equal(length, length.sort(descending=True).values)            # longest groups first
    for rows, (lo, hi) in zip(lay.rows, lay.cols):                              # no real token cut off
        assert int(r.attn_NT[rows].sum()) == int(r.attn_NT[rows, lo:hi].sum())
        assert r.attn_NT[rows, lo].any() and r.attn_NT[rows, hi - 1].any()      # and no column kept for nothing
    assert lay.positions() < N * 40


def test_micro_batches_keep_every_token_its_weight_and_its_row():
    """The trimmed micro-batches hold each row's real tokens, its loss weights and its advantage; the
    last stage's log-probs come back to (N, T−1) in the batch's order."""
    r = batch([3, 8, 5, 1, 6, 2], [30, 2, 11, 4, 25, 1], P=8, T=40)
    w = r.resp_NT1 / r.resp_NT1.sum()
    z = torch.zeros_like(w)
    for lay in (padded_layout(6, 40, 2), trimmed_layout(spans(r), 40, micro=2)):
        got_w, got_lp, adv = z.clone(), [], torch.zeros(6)
        for (ids, attn, sid), (targets, weight, a, old, ref) in micro_batches(r, lay, w, r.sampler_logp_NT1, z):
            lo = int(lay.cols[len(got_lp)][0])
            assert torch.equal(attn.sum(1), r.attn_NT[sid].sum(1)) and torch.equal(targets, ids[:, 1:])
            got_w[sid, lo:lo + weight.shape[1]] = weight
            adv[sid] = a
            got_lp.append(old)                         # stands in for the last stage's log-probs
        assert torch.equal(got_w, w) and torch.equal(adv, r.adv_N)
        assert torch.equal(host_logprobs(got_lp, lay), r.sampler_logp_NT1)


def test_shared_prompt_columns_follow_the_trim():
    """With shared prompts each trimmed micro-batch says how many of its own columns are prompt."""
    G = 2
    r = batch([3, 3, 6, 6], [20, 4, 2, 3], P=8, T=30)
    r.ids_NT[1::2, :8] = r.ids_NT[0::2, :8]                      # a group's samples share its prompt
    lay = trimmed_layout(spans(r), 30, micro=2, group=G)
    z = torch.zeros_like(r.resp_NT1)
    for (ids, attn, sid, pg), _ in micro_batches(r, lay, z, z, z, share=G):
        first_response = int(r.resp_NT1[sid].sum(0).nonzero().min()) + 1
        lo = lay.cols[[torch.equal(x, sid) for x in lay.rows].index(True)][0]
        assert pg.tolist() == [first_response - lo, G]


def test_the_rule_trims_when_the_bytes_saved_pay_for_the_shape_messages():
    """Like lengths: nothing saved pays for DeepSpeed's 1 KB per micro-batch and cut, padded. A long
    tail: trimmed. `always` and `never` force either; one stage (no cuts) trims whenever it saves."""
    like = spans(batch([8] * 16, [5, 6] * 8, T=14))
    tail = spans(batch([4] * 16, [2] * 15 + [30], T=40))
    cuts = [154 * 2] * 7                                         # prf95 at d = 1536, a training pass
    assert not choose_layout(like, 14, 4, 1, cuts, "auto").trimmed
    lay = choose_layout(tail, 40, 4, 1, cuts, "auto")
    saved = 16 * 40 - lay.positions()
    assert lay.trimmed and saved * sum(cuts) >= 4 * 7 * SHAPE_MESSAGE
    assert choose_layout(like, 14, 4, 1, cuts, "always").trimmed
    assert not choose_layout(tail, 40, 4, 1, cuts, "never").trimmed
    assert choose_layout(like, 14, 4, 1, [], "auto").trimmed                   # one stage: no messages
    # at the threshold: the saved slots' bytes equal the messages
    per_slot = 4 * 7 * SHAPE_MESSAGE / saved / 7
    assert choose_layout(tail, 40, 4, 1, [per_slot] * 7, "auto").trimmed
    assert not choose_layout(tail, 40, 4, 1, [per_slot * 0.99] * 7, "auto").trimmed


@pytest.mark.parametrize("name, fwd, back", [("dense", 1536 * 2, 1536 * 2), ("prf", 77 * 2, 77 * 2)])
def test_a_token_slots_bytes_on_a_cut(name, fwd, back):
    c = CodecConfig(name=name, keep=77, payload_dtype="bfloat16") if name == "prf" else CodecConfig(name=name)
    codec = build_codec(c, 1536, [4, 4, 4, 4, 3, 3, 3, 3])
    assert codec.token_bytes(3, 2, False, 4096) == fwd
    assert codec.token_bytes(3, 2, True, 4096) == fwd + back
    with codec.off():                               # as configured: the probe lays a batch out as the codec does
        assert codec.token_bytes(3, 2, True, 4096) == fwd + back
