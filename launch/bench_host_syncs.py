"""Host reads on a stage's hot path, counted: what makes a GPU stream wait for the CPU.

    python launch/bench_host_syncs.py [--model-dir DIR] [--tokens 64] [--batch 8]

Runs, in one process on the CPU, what the pipeline's stages run for one micro-batch at a cut: the
embedding, the cut's two decoder layers (encode after one, decode before the next), the final norm,
the head and the GRPO token loss, forward and backward, for each codec with the prompt shared and
not. Under a dispatch mode it counts the calls that need a value on the host: `.item()`,
`bool()`/`int()`/`float()` of a tensor (aten._local_scalar_dense), `nonzero`, boolean-mask
indexing, `masked_select`. Each is a device-to-host copy that blocks the CPU
until the stream has caught up. Prints a table (one row per codec and sharing) and the seconds of
PRF's kept-set computation at the given shape and at 1.5B's (4096 tokens a micro-batch).
"""
import argparse
import collections
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default"}


class CountHostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        boolean_index = name.startswith("aten.index") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else []) or [])
        if name in HOST_READS or boolean_index:
            self.counts[name.split(".")[1] + (" (bool mask)" if boolean_index else "")] += 1
        return func(*args, **(kwargs or {}))


def codecs(d: int) -> dict:
    from ds_twocircuit.codec.boundary import Codec
    from ds_twocircuit.codec.geometry import keep_count
    from ds_twocircuit.codec.rotated import Budget
    k = keep_count(0, 0.05, d)
    return {"dense": Codec("dense", d=d, cuts={0}), "prf": Codec("prf", d=d, k=k, cuts={0}),
            "rotated": Codec("rotated", d=d, cuts={0}, fwd=Budget(d, d // 4, 2, 8, "gauss"), bwd=Budget(d, d // 4, 2))}


def one_pass(model_dir: str, codec, share: bool, B: int, T: int) -> collections.Counter:
    from ds_twocircuit.grpo.logprobs import head_logprobs
    from ds_twocircuit.grpo.loss import LossCoefs, grpo_token_loss
    from ds_twocircuit.model.pipe import Decoder, Embed, FinalNorm, load_hf_config, tied_head
    from ds_twocircuit.model.weights import SafetensorsReader
    config, reader = load_hf_config(model_dir, "sdpa"), SafetensorsReader(model_dir)
    mods = [Embed(config, reader), Decoder(config, 0, reader, codec, False, True),
            Decoder(config, 1, reader, codec, True, False), FinalNorm(config, reader)]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    P = T // 4
    if share:
        ids[1::2, :P] = ids[::2, :P]
    inputs = (ids, attn, torch.arange(B), *([torch.tensor([P, 2])] if share else []))
    w = torch.full((B, T - 1), 1.0 / (B * (T - 1)))
    with CountHostReads() as count, codec.keyed(3):
        h = inputs
        for m in mods:
            h = m(h)
        out = tied_head(mods[0], h)
        logp, _ = head_logprobs(out.h_BTD[:, :-1], out.weight_VD, ids[:, 1:], 1.0)
        loss, _ = grpo_token_loss(logp, logp.detach(), logp.detach(), torch.randn(B, generator=g), w,
                                  LossCoefs(kl_coef=0.001))
        loss.backward()
    return count.counts


def prf_seconds(d: int, tokens: int, repeats: int = 20) -> float:
    from ds_twocircuit.codec import prf
    from ds_twocircuit.codec.geometry import keep_count
    keys = prf.token_keys(0, 3, 7, torch.arange(tokens)[:, None] // 64, torch.arange(tokens)[:, None] % 64)
    t0 = time.perf_counter()
    for _ in range(repeats):
        prf.kept_channels(keys, d, keep_count(0, 0.05, d))
    return (time.perf_counter() - t0) / repeats


def random_model(d: int) -> str:
    """A randomly initialised 2-layer Qwen2 of width d (12 heads over 2 KV heads at 1536) with a small
    vocabulary, saved to a temporary directory: host reads depend on shapes, not on weights."""
    import tempfile

    from transformers import Qwen2Config, Qwen2ForCausalLM
    heads = max(1, d // 128)
    cfg = Qwen2Config(hidden_size=d, intermediate_size=4 * d, num_hidden_layers=2, num_attention_heads=heads,
                      num_key_value_heads=max(1, heads // 6), vocab_size=1000, tie_word_embeddings=True)
    out = tempfile.mkdtemp(prefix="syncs")
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None, help="an HF model directory (default: a random 2-layer Qwen2 of --width)")
    ap.add_argument("--width", type=int, default=1536, help="hidden size of the random model (Qwen2.5-Math-1.5B's)")
    ap.add_argument("--tokens", type=int, default=64, help="columns of the micro-batch")
    ap.add_argument("--batch", type=int, default=8, help="rows of the micro-batch")
    a = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = a.model_dir or random_model(a.width)
    from ds_twocircuit.model.pipe import load_hf_config
    d = load_hf_config(str(model_dir), "sdpa").hidden_size
    print(f"{model_dir}: width {d}, a micro-batch of {a.batch} × {a.tokens}")
    print("| codec | prompt shared | host reads, forward + backward of one micro-batch at one cut | by kind |")
    print("|---|---|---|---|")
    for name, codec in codecs(d).items():
        for share in (False, True):
            c = one_pass(str(model_dir), codec, share, a.batch, a.tokens)
            print(f"| {name} | {'yes' if share else 'no'} | {sum(c.values())} | "
                  + ", ".join(f"{k} {v}" for k, v in sorted(c.items())) + " |")
    for d_, tok in ((d, a.batch * a.tokens), (1536, 4096)):
        print(f"PRF kept sets, width {d_}, {tok} tokens: {prf_seconds(d_, tok) * 1e3:.2f} ms a call")


if __name__ == "__main__":
    main()
