"""Device placement: the pipeline's stage modules forward and backward, every codec's wire, the loss
and the sign correction run on a device that is not the CPU, with nothing allocated on the CPU in
between (standin_device.py: CPU data under CUDA's placement rules, so data-dependent code runs).
"""
import contextlib

import pytest
import torch

from standin_device import STANDIN, data, on, placed, to_standin

B, T, G = 4, 10, 2


def codecs(d: int):
    from ds_twocircuit.codec.boundary import Codec
    from ds_twocircuit.codec.rotated import Budget
    q, _ = torch.linalg.qr(torch.randn(d, 8, generator=torch.Generator().manual_seed(0)))
    low = Codec("lowrank", d=d, k=8, cuts={0})
    low.bases = {0: q}
    return {"dense": Codec("dense", d=d, cuts={0}), "prf": Codec("prf", d=d, k=8, cuts={0}), "lowrank": low,
            "rotated": Codec("rotated", d=d, cuts={0}, fwd=Budget(d, 16, 3, 8), bwd=Budget(d, 16, 4)),
            "rotated_gauss": Codec("rotated", d=d, cuts={0}, fwd=Budget(d, 16, 2, 8, "gauss"), bwd=Budget(d, 16, 4)),
            "rotated_rank": Codec("rotated", d=d, cuts={0}, fwd=Budget(d, 16, 3, 8), bwd=Budget(d, 16, 4), bwd_rank=2)}


def stage_chain(model_dir, codec, where):
    """Embedding, the cut's two decoder layers (encode after layer 0, decode before layer 1), the
    final norm and the head, as the pipeline's stages hold them."""
    from ds_twocircuit.model.pipe import Decoder, Embed, FinalNorm, LMHead, load_hf_config
    from ds_twocircuit.model.weights import SafetensorsReader
    config, reader = load_hf_config(model_dir, "sdpa"), SafetensorsReader(model_dir)
    mods = [Embed(config, reader), Decoder(config, 0, reader, codec, False, True),
            Decoder(config, 1, reader, codec, True, False), FinalNorm(config, reader)]
    head = None if config.tie_word_embeddings else LMHead(config, reader)
    return [where.module(m) for m in mods], where.module(head) if head is not None else None


def batch(vocab: int, share: bool):
    """Left-padded prompts of 5 columns, ragged responses; with `share` each group's G rows share the prompt."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[0, :2] = 0
    attn[1, 8:] = 0
    attn[3, 7:] = 0
    if share:
        ids[1::G, :5], attn[1::G, :5] = ids[::G, :5], attn[::G, :5]
    resp = torch.zeros(B, T - 1)
    resp[:, 4:] = attn[:, 5:].float()
    return ids, attn, resp


class Placement:
    """Where the chain runs: the stand-in device here, a real CUDA device in tests/test_gpu.py."""

    def __init__(self, device: str):
        self.device = torch.device(device) if device != "standin" else STANDIN
        self.standin = device == "standin"

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return on(t) if self.standin else t.to(self.device)

    def module(self, m):
        return to_standin(m) if self.standin else m.to(self.device)

    def context(self):
        return placed() if self.standin else contextlib.nullcontext()


def run_chain(model_dir, name: str, share: bool, where: Placement) -> None:
    """The chain of the module docstring forward and backward on `where`, with each codec on its cut."""
    from ds_twocircuit.grpo.logprobs import head_logprobs
    from ds_twocircuit.grpo.loss import LossCoefs
    from ds_twocircuit.pipeline.passes import _GRPOLoss
    from ds_twocircuit.model.pipe import tied_head
    if name == "rotated_rank" and share:
        pytest.skip("the rank code's width depends on the token count; the config refuses it with shared prompts")
    codec = codecs(32)[name]
    if name == "lowrank":
        codec.bases = {0: where(codec.bases[0])}
    mods, head = stage_chain(model_dir, codec, where)
    ids, attn, resp = batch(mods[0].embed_tokens.num_embeddings, share)
    inputs = (where(ids), where(attn), where(torch.arange(B)), *([where(torch.tensor([5, G]))] if share else []))
    with where.context(), codec.keyed(3):
        h = mods[0](inputs)
        for m in mods[1:3]:
            h = m(h)
        h = mods[3](h)
        out = tied_head(mods[0], h) if head is None else head(h)
        logp, _ = head_logprobs(out.h_BTD[:, :-1].detach(), out.weight_VD.detach(), where(ids[:, 1:]), 0.7)
        old, ref = logp + 0.01, logp - 0.02
        labels = (where(ids[:, 1:]), where(resp / resp.sum()), where(torch.tensor([1.0, -1.0, 0.5, -0.5])), old, ref)
        loss_fn = _GRPOLoss(LossCoefs(kl_coef=0.05), 0.7, scale=2, old_is_current=False)
        loss = loss_fn(out, labels)         # the last stage's loss_fn, as DeepSpeed calls it
        loss.backward()
    sums = loss_fn.sums
    same = lambda t: t.device.type == where.device.type
    assert same(loss) and len(sums) > 5 and all(same(v) for v in sums.values())
    grads = [p.grad for m in mods for p in m.parameters()]
    assert all(g is not None and same(g) for g in grads)
    assert torch.isfinite(data(loss)) and all(torch.isfinite(data(g)).all() for g in grads)


CODECS = ["dense", "prf", "lowrank", "rotated", "rotated_gauss", "rotated_rank"]


@pytest.mark.parametrize("share", [False, True], ids=["unshared", "shared"])
@pytest.mark.parametrize("name", CODECS)
def test_stages_codecs_and_loss_run_forward_and_backward_on_the_device(tiny_model, name, share):
    run_chain(tiny_model, name, share, Placement("standin"))


def test_the_standin_refuses_what_cuda_refuses():
    """The placement test can fail: a CPU arange meeting a device tensor, .numpy() without .cpu()."""
    x = on(torch.ones(2, 3))
    with placed():
        with pytest.raises(RuntimeError, match="meets a tensor on the device"):
            x + torch.arange(3)
        with pytest.raises(RuntimeError, match="meets a tensor on the device"):
            torch.zeros(2, 3).scatter_(-1, torch.zeros(2, 1, dtype=torch.long), x[:, :1])
        with pytest.raises(Exception):
            x.numpy()
        assert (x + torch.arange(3, device=x.device)).device == STANDIN
        assert x.cpu().numpy().shape == (2, 3)


def test_the_sign_correction_runs_on_the_device():
    """The correction and its agreement counts on device gradients with device sign bits, no host
    read per tensor; sign(M) = 0 reads the gradient unchanged."""
    from ds_twocircuit.anchor.correction import SignCorrection
    g = torch.tensor([1.0, -2.0, 3.0, 5.0, -1.0, 2.0])
    s = torch.tensor([1, 1, -1, 0, -1, 0], dtype=torch.int8)
    views = [("w", on(g.clone()), 0, True)]
    corr = SignCorrection(views, 0.25)
    with placed(), corr.applying({"w": on(s)}) as count:
        corr.apply()
    assert views[0][1].device == STANDIN
    assert torch.equal(data(views[0][1]), torch.tensor([1.0, 1.0, -1.5, 5.0, -1.0, 2.0]))
    assert (int(count.agree), int(count.numel)) == (2, 4)


def test_the_last_stage_returns_log_probs_beside_the_rollout_on_the_host():
    """A pass's log-probs (the last stage's, on the device) meet the rollout's host tensors in the
    actor (the mismatch metrics against the sampler's log-probs, the probe's KL to the reference):
    passes hand them over on the host."""
    from ds_twocircuit.grpo.loss import k3_kl
    from ds_twocircuit.metrics.health import mismatch_sums
    from ds_twocircuit.model.pipe import HeadOut
    from ds_twocircuit.pipeline.layout import padded_layout
    from ds_twocircuit.pipeline.passes import _LogProbs, host_logprobs
    g = torch.Generator().manual_seed(2)
    out = HeadOut(on(torch.randn(2, 6, 4, generator=g)), on(torch.randn(11, 4, generator=g)))
    targets = on(torch.randint(0, 11, (2, 5), generator=g))
    sampler_logp, w = -torch.rand(2, 5, generator=g), torch.full((2, 5), 0.1)     # the rollout's, on the host
    rec = _LogProbs(1.0)
    with placed():
        rec(out, (targets,))
        logp = host_logprobs(rec.logps, padded_layout(2, 6, 2))
        sums = mismatch_sums(sampler_logp, logp, w)
        kl = k3_kl(logp, sampler_logp, w > 0)
    assert logp.device.type == "cpu" and torch.isfinite(kl).all() and all(torch.isfinite(v) for v in sums.values())


def test_the_sampler_and_the_reference_score_on_the_device(tiny_model):
    """The teacher-forced pass the HF sampler scores with and the reference policy runs
    (sampler/reference.py) on the device, its inputs moved there from the rollout's host tensors and
    its log-probs handed back on the host; the same numbers as on the CPU but for the order of float
    sums (≤ 1.1e-6 measured). HF `generate` itself is tests/test_gpu.py's, on CUDA: its internals make
    tensors on the model's device that this stand-in cannot follow."""
    from ds_twocircuit.sampler.hf import HFSampler
    from ds_twocircuit.sampler.reference import ReferenceLogProbs, response_logprobs
    s = HFSampler(tiny_model)
    gen = s.generate(["12+3=", "7+8="], 2, max_new_tokens=6, seed=1)
    want = ReferenceLogProbs(tiny_model)(gen.ids_NT, gen.attn_NT, gen.resp_NT1, 0.7)
    model = to_standin(s.model)
    with placed():
        got = response_logprobs(model, gen.ids_NT, gen.attn_NT, gen.resp_NT1, 0.7, device=STANDIN)
    assert got.device.type == "cpu" and not isinstance(got, type(on(torch.zeros(1))))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (gen.resp_NT1 > 0).sum() > 4 and bool((got[gen.resp_NT1 > 0] < 0).all())
