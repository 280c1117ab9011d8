"""The embedded base model: a small Qwen2 with a character tokenizer, warm-started locally.

No download anywhere. The model has the reference's 28 decoder layers (so the 8-stage
4/4/4/4/3/3/3/3 layout is real) at a small width, tied embeddings like Qwen2.5-1.5B, and a
17-token character vocabulary (digits, `+ - * =`, pad/eos/unk). A supervised warm-start on the
synthetic task's training split brings it to roughly a base model's ~0.35 held-out greedy
accuracy, so GRPO has something to improve. `model.embedded=wide` builds the same at d = 384
(`model.wide`: 60.6 M parameters, 400 warm-start steps to 0.31, about 35 minutes on 2 CPU cores),
the benchmark tier for learning at a width where 5 % of a cut is 19 channels. Either is built once
per configuration and held-out size
(`data.eval_size`: the warm start never sees a held-out row) and cached under
`$DS_TWOCIRCUIT_CACHE` (default `~/.cache/ds_twocircuit`); a file lock makes concurrent ranks
wait for one builder. Deterministic for a fixed seed on a given CPU type (other CPUs' math
kernels round differently: see the README).
"""
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
from dataclasses import asdict

import torch
from filelock import FileLock
from tqdm import tqdm

CHARS = list("0123456789+-*=")
SPECIALS = ["<pad>", "<eos>", "<unk>"]


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def build_config(tiny, vocab_size: int):
    from transformers import Qwen2Config
    h = tiny.hidden_size
    return Qwen2Config(vocab_size=vocab_size, hidden_size=h, intermediate_size=tiny.intermediate_size or 4 * h,
                       num_hidden_layers=tiny.num_layers, num_attention_heads=tiny.num_heads,
                       num_key_value_heads=tiny.num_kv_heads, max_position_embeddings=256,
                       tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None)


def cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("DS_TWOCIRCUIT_CACHE", pathlib.Path.home() / ".cache" / "ds_twocircuit"))


def tiny_model_key(tiny, eval_size: int) -> str:
    """The cache key: the model's config and the held-out split its warm start left out."""
    return hashlib.sha256(json.dumps({**asdict(tiny), "eval_size": eval_size}, sort_keys=True).encode()).hexdigest()[:12]


def ensure_tiny_model(tiny, eval_size: int, name: str = "tiny") -> str:
    """Path of the model warm-started on the synthetic training rows that the first `eval_size`
    held-out rows are not among; builds it (once, under a lock) if missing. `name` ('tiny' or
    'wide', `model.embedded`) only names the cache directory; the key is the configuration."""
    key = tiny_model_key(tiny, eval_size)
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{name}-{key}"
    with FileLock(str(root / f"{name}-{key}.lock")):
        if not (target / "warmup.json").is_file():
            tmp = pathlib.Path(tempfile.mkdtemp(dir=root, prefix=f".{name}-{key}-"))
            build_tiny_model(tiny, tmp, eval_size)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)
    return str(target)


def build_tiny_model(tiny, out_dir: pathlib.Path, eval_size: int) -> None:
    from transformers import Qwen2ForCausalLM

    from ..data.synthetic import synthetic_splits
    from ..data.verify import exact_integers
    from ..sampler.hf import HFSampler, greedy_accuracy
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        torch.manual_seed(tiny.seed)
        tok = build_tokenizer()
        model = Qwen2ForCausalLM(build_config(tiny, len(tok)))
        train, held = synthetic_splits(eval_size)
        warm_start(model, tok, train["problem"], train["answer"], tiny)
        model.save_pretrained(out_dir)
        tok.save_pretrained(out_dir)
        acc = greedy_accuracy(HFSampler(str(out_dir)), held["problem"], held["answer"], exact_integers, 5)
        (out_dir / "warmup.json").write_text(json.dumps({"held_out_acc": acc, **asdict(tiny), **built_with()}))
        print(f"[ds_twocircuit] embedded base model built: held-out greedy accuracy {acc:.3f} -> {out_dir}")
    finally:
        torch.set_num_threads(threads)


def built_with() -> dict:
    """What else decides the built weights: the warm start's steps amplify the kernels' rounding, so
    the same configuration builds another model on another CPU path (a held-out score that differs
    from another machine's build says so; the cache key names the configuration only)."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": os.cpu_count() or 1}


def warm_start(model, tok, problems: list[str], answers: list[str], tiny, probe=None, probe_every: int = 0) -> None:
    """Supervised steps on `problem answer<eos>`, loss on the answer tokens only. `probe(step, loss)`,
    if given, is called every `probe_every` steps (it only reads the model: the steps are the same
    with and without it)."""
    enc = [tok.encode(p + a, add_special_tokens=False) + [tok.eos_token_id] for p, a in zip(problems, answers)]
    plen = [len(tok.encode(p, add_special_tokens=False)) for p in problems]
    T = max(map(len, enc))
    ids = torch.full((len(enc), T), tok.pad_token_id)
    labels = torch.full((len(enc), T), -100)
    for i, (e, p) in enumerate(zip(enc, plen)):
        ids[i, :len(e)] = torch.tensor(e)
        labels[i, p:len(e)] = torch.tensor(e[p:])
    attn = (labels != -100) | (torch.arange(T) < torch.tensor(plen)[:, None])
    opt = torch.optim.AdamW(model.parameters(), lr=tiny.warmup_lr)
    gen = torch.Generator().manual_seed(tiny.seed)
    model.train()
    for step in tqdm(range(1, tiny.warmup_steps + 1), desc="warm-start base model", mininterval=5):
        idx = torch.randint(len(enc), (tiny.warmup_batch,), generator=gen)
        loss = model(input_ids=ids[idx], attention_mask=attn[idx].long(), labels=labels[idx]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if probe is not None and step % probe_every == 0:
            probe(step, loss.item())
    model.eval()
