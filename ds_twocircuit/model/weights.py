"""HF safetensors ↔ stage tensors: per-stage reads, HF export, the sampler's sync payload.

A stage opens the checkpoint's safetensors files with `safe_open` and reads only the tensors of its
own layers, so a 1.5B model is never materialised whole on any rank. Export is the reverse: each
stage writes one shard with HF names; rank 0 writes the index, config and tokenizer, giving a
directory that `AutoModelForCausalLM.from_pretrained` (and vLLM) load.
"""
import json
import os
import pathlib
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def base_model_dir(tc) -> str:
    """The run's base model: `model.path` (a directory, or a hub name in the local cache), else the
    embedded model (`model.embedded`) warm-started without the run's held-out rows (built once, model/tiny.py)."""
    if tc.model.path:
        return str(resolve_model_dir(tc.model.path))
    from .tiny import ensure_tiny_model
    return ensure_tiny_model(tc.model.embedded_config(), tc.data.eval_size, tc.model.embedded)


def resolve_model_dir(path: str) -> pathlib.Path:
    p = pathlib.Path(path)
    if p.is_dir():
        return p
    from huggingface_hub import snapshot_download  # a hub name already in the local cache
    return pathlib.Path(snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"],
                                          local_files_only=True))


class SafetensorsReader:
    """name → tensor for an HF checkpoint directory (single file or sharded with an index)."""

    def __init__(self, model_dir: str | os.PathLike):
        d = pathlib.Path(model_dir)
        index = d / "model.safetensors.index.json"
        if index.is_file():
            wmap = json.loads(index.read_text())["weight_map"]
            self.file_of = {n: d / f for n, f in wmap.items()}
        else:
            f = d / "model.safetensors"
            with safe_open(str(f), "pt") as h:
                self.file_of = {n: f for n in h.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        by_file: dict[pathlib.Path, list[str]] = {}
        for n in names:
            if n not in self.file_of:
                raise KeyError(f"tensor '{n}' not found in the checkpoint")
            by_file.setdefault(self.file_of[n], []).append(n)
        out = {}
        for f, ns in by_file.items():
            with safe_open(str(f), "pt") as h:
                out.update({n: h.get_tensor(n) for n in ns})
        return out


def load_module_from(module: torch.nn.Module, reader: SafetensorsReader, prefix: str) -> torch.nn.Module:
    """Materialise a meta-device module's parameters from the checkpoint (fp32), names = prefix + local."""
    names = [n for n, _ in module.named_parameters()]
    tensors = reader.read([prefix + n for n in names])
    state = {n: tensors[prefix + n].float() for n in names}
    module.load_state_dict(state, assign=True, strict=False)
    return module


def shard_name(stage: int, num_stages: int) -> str:
    return f"model-{stage + 1:05d}-of-{num_stages:05d}.safetensors"


def write_stage_shard(out_dir: pathlib.Path, stage: int, num_stages: int, named: dict[str, torch.Tensor]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().contiguous().cpu() for n, t in named.items()}, str(out_dir / shard_name(stage, num_stages)),
              metadata={"format": "pt"})


def write_index(out_dir: pathlib.Path, names_per_stage: list[list[str]], config, tokenizer_dir: str | None) -> None:
    wmap = {n: shard_name(s, len(names_per_stage)) for s, names in enumerate(names_per_stage) for n in names}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}, indent=1))
    config.save_pretrained(out_dir)
    if tokenizer_dir:
        from transformers import AutoTokenizer
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
        gen = pathlib.Path(tokenizer_dir) / "generation_config.json"   # its end-of-sequence ids, as the source lists them
        if gen.is_file():
            shutil.copyfile(gen, out_dir / "generation_config.json")
