"""The reference policy's log-probs computed beside the sampler (`grpo.ref_logprobs = "sampler"`).

The KL term needs log π_ref of every sampled response token. Computed in the pipeline, that is a
whole extra pass of the base weights through every cut, carrying nearly the tensor the train pass
carries again. Here rank 0, which holds the prompts and the sequences already, runs a dense fp32
HF model of the base weights over them (as verl's reference worker does) and only the per-token
floats travel to the last stage: 4 bytes per response token instead of a forward through 7 cuts.

The numbers are the codec-off pipeline's: the same positions ((cumsum(attn) − 1) clamped at 0, the
rule HF `generate` and the pipeline use) and the same `head_logprobs`, from the final hidden states
and the head's weight a chunk of tokens at a time (never the whole-vocabulary logits). With a codec on, the KL
term then compares the codec's view of the policy with the dense reference, so it carries the
codec's own gap, which a compressed reference pass cancels by seeing the same codes.
"""
import torch
from transformers import AutoModelForCausalLM

from ..grpo.logprobs import head_logprobs


class ReferenceLogProbs:
    """log π_ref(target) of given sequences, with the base weights at `model_dir` in fp32 on `device`
    (the rank's accelerator; the CPU by default)."""

    def __init__(self, model_dir: str, attn_implementation: str = "sdpa", rows_per_forward: int = 64, device=None):
        self.device = torch.device(device or "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation=attn_implementation).eval().to(self.device)
        self.rows = rows_per_forward

    def __call__(self, ids_NT: torch.Tensor, attn_NT: torch.Tensor, resp_NT1: torch.Tensor,
                 temperature: float) -> torch.Tensor:
        """→ (N, T−1) float32: log π_ref of ids[:, j+1] at column j on response targets, 0 elsewhere."""
        return response_logprobs(self.model, ids_NT, attn_NT, resp_NT1, temperature, self.rows, self.device)


@torch.no_grad()
def response_logprobs(model, ids_NT: torch.Tensor, attn_NT: torch.Tensor, resp_NT1: torch.Tensor,
                      temperature: float, rows: int = 64, device=None) -> torch.Tensor:
    """An HF causal LM's log-probs of given sequences' response tokens in one teacher-forced pass (its
    own dtype, the logits cast to fp32 as `generate`'s are) on `device` (the model's), `rows` sequences
    a forward: (N, T−1) float32 on the host, log p(ids[:, j+1]) at column j on response targets, 0
    elsewhere."""
    out, head_VD = [], model.get_output_embeddings().weight
    for i in range(0, ids_NT.shape[0], rows):
        ids, attn = ids_NT[i:i + rows].to(device), attn_NT[i:i + rows].to(device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        h = model.get_decoder()(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).last_hidden_state
        out.append(head_logprobs(h[:, :-1], head_VD, ids[:, 1:], temperature)[0].cpu())
    return torch.cat(out) * resp_NT1


def pack(values_NT1: torch.Tensor, resp_NT1: torch.Tensor) -> torch.Tensor:
    """The response targets' values, in row-major order: what crosses the wire, (Σ resp,)."""
    return values_NT1[resp_NT1 > 0].contiguous()


def unpack(flat: torch.Tensor, resp_NT1: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack` on a receiver that holds the response mask: (N, T−1), 0 off the response."""
    out = torch.zeros(resp_NT1.shape, dtype=flat.dtype)
    out[resp_NT1 > 0] = flat
    return out
