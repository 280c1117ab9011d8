"""An HF Qwen2/Llama causal LM as a DeepSpeed `PipelineModule` with an explicit layer split.

Layer items, in order: `Embed` (stage 0) · one `Decoder` per HF decoder layer · `FinalNorm` · the
LM head (the embedding's tied copy via `TiedLayerSpec` when the model ties them, else `LMHead`),
the last two on the last stage. The head returns `HeadOut(h, W)`, not the logits: the loss makes
them a chunk of tokens at a time (grpo/logprobs.py), so (B, T, V) never exists whole.
`layers_per_stage` assigns decoder layers to stages.

What crosses a stage boundary is `(h float, rows_B3 int32)`: the hidden state (or what the codec
sends for it, `Codec.wire_out`: one tensor, or the rotated codec's fp16 carrier and uint8 payload;
codec/boundary.py), floats first (DeepSpeed sends a gradient back for every float it receives, and
matches its receive buffers by position). A sequence's real tokens
are contiguous (left-padded prompt, right-padded response), so `rows_B3` = [first, last+1,
sample_id] replaces the (B, T) attention mask on the wire: 12 bytes per sequence, one tensor (each
tensor of the tuple costs its own send and shape metadata). Rotary
positions and the 4-D causal + padding mask are rebuilt on every stage from it: position =
(cumsum(attn) − 1) clamped at 0, the rule HF `generate` uses for left-padded prompts. `sample_id_B`
is the stable id of each sequence in the step's batch (the PRF codec keys its masks with it). With
`grpo.share_prompts` the rows carry two more columns, [P, G] (the shared prompt columns, the group
size), and each cut sends a group's prompt once (codec/shared_prompts.py).

Each layer item is built on the meta device and materialised from the checkpoint's safetensors
files, so a rank only ever holds its own stage. The model knows nothing of pipelining; these
wrappers only adapt HF's layer signature to DeepSpeed's one-tuple interface.
"""
import importlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from transformers import AutoConfig
from transformers.masking_utils import create_causal_mask

from ..codec import shared_prompts
from ..codec.boundary import Codec
from ..codec.geometry import cut_layers
from .weights import SafetensorsReader, load_module_from


def hf_module_classes(config):
    """(DecoderLayer, RMSNorm, RotaryEmbedding) classes of the config's model family."""
    mod = importlib.import_module(type(config).__module__.replace("configuration_", "modeling_"))
    pick = lambda suffix: next(getattr(mod, n) for n in dir(mod) if n.endswith(suffix) and not n.startswith("_"))
    return pick("DecoderLayer"), pick("RMSNorm"), pick("RotaryEmbedding")


def positions_from_mask(attn_BT: torch.Tensor) -> torch.Tensor:
    return (attn_BT.cumsum(-1) - 1).clamp(min=0)


def span_from_mask(attn_BT: torch.Tensor) -> torch.Tensor:
    """(B, T) 0/1 mask with contiguous ones (check_contiguous) → (B, 2) [first, last+1), on its device."""
    T = attn_BT.shape[1]
    t = torch.arange(T, device=attn_BT.device)
    start = torch.where(attn_BT.bool(), t, T).min(1).values
    end = torch.where(attn_BT.bool(), t + 1, 0).max(1).values
    return torch.stack([start, end], 1)


def check_contiguous(attn_BT: torch.Tensor) -> None:
    """Raise unless every row's ones are contiguous: what span_from_mask assumes. A data-dependent
    check, so it runs on the host before a pass (passes.micro_batches), not in the stage's forward."""
    if not torch.equal(mask_from_span(span_from_mask(attn_BT), attn_BT.shape[1]), attn_BT.long()):
        raise ValueError("attention mask must be contiguous per row (left-padded prompt, right-padded response)")


def mask_from_span(span_B2: torch.Tensor, T: int) -> torch.Tensor:
    t = torch.arange(T, device=span_B2.device)
    return ((t >= span_B2[:, :1]) & (t < span_B2[:, 1:2])).long()


class Embed(torch.nn.Module):
    def __init__(self, config, reader):
        super().__init__()
        with torch.device("meta"):
            self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        load_module_from(self, reader, "model.")

    def forward(self, inputs):
        ids_BT, attn_BT, sid_B, *share = inputs       # share: [P, G] with the prompt shared
        rows = [span_from_mask(attn_BT), sid_B[:, None]]
        if share:
            rows.append(share[0].to(sid_B.dtype).expand(len(sid_B), 2))
        return self.embed_tokens(ids_BT), torch.cat(rows, 1).int()

    def hf_parameters(self):
        return {"model.embed_tokens.weight": self.embed_tokens.weight}


class HeadOut(NamedTuple):
    """The last stage's output: the final hidden states and the head's weight, logits = h·Wᵀ."""
    h_BTD: torch.Tensor
    weight_VD: torch.Tensor

    def logits(self) -> torch.Tensor:
        """The whole (B, T, V) logits, for checks against HF; the passes never make them."""
        return F.linear(self.h_BTD, self.weight_VD)


def tied_head(embed: Embed, h_BTD: torch.Tensor) -> HeadOut:
    return HeadOut(h_BTD, embed.embed_tokens.weight)


class Decoder(torch.nn.Module):
    """One HF decoder layer; decodes its input if a cut sits before it, encodes its output if after."""

    def __init__(self, config, layer_idx: int, reader, codec: Codec, decode_in: bool, encode_out: bool):
        super().__init__()
        layer_cls, _, rotary_cls = hf_module_classes(config)
        self.config, self.layer_idx = config, layer_idx
        self.codec, self.decode_in, self.encode_out = codec, decode_in, encode_out
        with torch.device("meta"):
            self.layer = layer_cls(config, layer_idx)
        load_module_from(self.layer, reader, f"model.layers.{layer_idx}.")
        self.rotary = rotary_cls(config=config)   # non-persistent buffers only

    def forward(self, inputs):
        *wire, rows = inputs        # (h, rows), or after a cut what the codec sent (wire_out)
        rows = rows.long()          # (B, 3) [first, last+1, sample id], + [P, G] with the prompt shared
        # a shared prompt's [P, G]: a host read, made only by the layers at a cut, which need it
        shared = rows.shape[1] == 5 and (self.decode_in or self.encode_out)
        P, G = (int(rows[0, 3]), int(rows[0, 4])) if shared else (0, 0)
        T = shared_prompts.padded_length(wire, len(rows), P, G) if P and self.decode_in else wire[0].shape[1]
        attn_BT, sid_B = mask_from_span(rows, T), rows[:, 2]
        pos_BT = positions_from_mask(attn_BT)
        h = wire[0]
        if self.decode_in:
            dtype, layer = next(self.layer.parameters()).dtype, self.layer_idx - 1
            h = (shared_prompts.receive(self.codec, tuple(wire), pos_BT, sid_B, layer, dtype, P, G) if P else
                 self.codec.wire_in(tuple(wire), pos_BT, sid_B, layer, dtype))
        # the cache goes in by position: its keyword is past_key_values before transformers 5.20, cache after
        mask = create_causal_mask(self.config, h, attn_BT, None, position_ids=pos_BT)
        cos_sin = self.rotary(h, pos_BT)
        h = self.layer(h, attention_mask=mask, position_ids=pos_BT, position_embeddings=cos_sin)
        if self.encode_out:
            out = (shared_prompts.send(self.codec, h, pos_BT, sid_B, self.layer_idx, P, G) if P else
                   self.codec.wire_out(h, pos_BT, sid_B, self.layer_idx))
            # DeepSpeed runs the stage's backward once per float tensor sent and adds the passes'
            # input gradients: with two, codes that are not numbers (rotated) would be added
            assert sum(t.is_floating_point() for t in out) == 1, [t.dtype for t in out]
            return (*out, rows.int())
        return h, rows.int()

    def hf_parameters(self):
        return {f"model.layers.{self.layer_idx}.{n}": p for n, p in self.layer.named_parameters()}


class FinalNorm(torch.nn.Module):
    def __init__(self, config, reader):
        super().__init__()
        _, norm_cls, _ = hf_module_classes(config)
        with torch.device("meta"):
            self.norm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)
        load_module_from(self, reader, "model.")

    def forward(self, inputs):
        return self.norm(inputs[0])

    def hf_parameters(self):
        return {"model.norm.weight": self.norm.weight}


class LMHead(torch.nn.Module):
    def __init__(self, config, reader):
        super().__init__()
        with torch.device("meta"):
            self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        load_module_from(self, reader, "")

    def forward(self, h_BTD) -> HeadOut:
        return HeadOut(h_BTD, self.lm_head.weight)

    def hf_parameters(self):
        return {"lm_head.weight": self.lm_head.weight}


def load_hf_config(model_dir: str, attn_implementation: str):
    config = AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = attn_implementation
    config.use_cache = False
    return config


def layer_specs(config, reader, codec: Codec, layers_per_stage: list[int]) -> list:
    cuts = set(cut_layers(layers_per_stage))
    specs = [TiedLayerSpec("embed", Embed, config, reader, tied_weight_attr=["embed_tokens.weight"])
             if config.tie_word_embeddings else LayerSpec(Embed, config, reader)]
    specs += [LayerSpec(Decoder, config, i, reader, codec, i - 1 in cuts, i in cuts)
              for i in range(config.num_hidden_layers)]
    specs.append(LayerSpec(FinalNorm, config, reader))
    specs.append(TiedLayerSpec("embed", Embed, config, reader, forward_fn=tied_head,
                               tied_weight_attr=["embed_tokens.weight"])
                 if config.tie_word_embeddings else LayerSpec(LMHead, config, reader))
    return specs


def explicit_parts(layers_per_stage: list[int]) -> list[int]:
    """Item boundaries: stage 0 also holds the embedding, the last stage the norm and head."""
    parts, acc = [0], 1
    for n in layers_per_stage:
        acc += n
        parts.append(acc)
    parts[-1] += 2
    return parts


class TwoCircuitPipe(PipelineModule):
    """`PipelineModule` with the split given explicitly as decoder layers per stage.

    With DeepSpeed's `pipeline.activation_checkpoint_interval` > 0, runs of that many decoder layers
    are recomputed in the backward; the embedding, norm and head never are (a checkpointed segment
    made only of decoders: DeepSpeed's reentrant checkpoint would give the embedding no gradient, its
    input being token ids). A cut's codec runs again in the recompute and gives the same codes: its
    keys are functions of (seed, cut, step, sample, position), never of a call count."""

    def __init__(self, model_dir: str, layers_per_stage: list[int], loss_fn, attn_implementation="sdpa",
                 codec: Codec | None = None, **kw):
        self.config = load_hf_config(model_dir, attn_implementation)
        self.model_dir = str(model_dir)
        self.layers_per_stage = list(layers_per_stage)
        self.codec = codec or Codec()
        super().__init__(layers=layer_specs(self.config, SafetensorsReader(model_dir), self.codec, self.layers_per_stage),
                         num_stages=len(layers_per_stage), loss_fn=loss_fn, partition_method="uniform",
                         checkpointable_layers=["Decoder"], **kw)

    def _partition_layers(self, method="uniform"):
        self.parts = explicit_parts(self.layers_per_stage)
        assert self.parts[-1] == len(self._layer_specs), (self.parts, len(self._layer_specs))
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

    def _synchronize_tied_weights(self):
        """DeepSpeed's broadcast of each tied weight from its first stage, outside autograd. The parent
        runs it in place on the parameter in grad mode (from PipelineModule.__init__, which dispatches
        to this override, and from load_state_dir), and c10d::broadcast_ has no autograd kernel:
        PyTorch notes the in-place op on the parameter and warns, at the first backward through it,
        that this "may lead to silently incorrect behavior". Copying weights between stages is not
        part of the model's function: no_grad says so (the same values are copied)."""
        with torch.no_grad():
            super()._synchronize_tied_weights()

    @property
    def stage(self) -> int:
        return self.stage_id

    def hf_parameters(self) -> dict[str, torch.nn.Parameter]:
        """This stage's parameters under HF names; the tied head's copy belongs to stage 0."""
        out = {}
        for m in self.modules():
            if isinstance(m, (Decoder, FinalNorm, LMHead)) or (isinstance(m, Embed) and self.stage_id == 0):
                out.update(m.hf_parameters())
        return out

    def hf_parameters_all(self) -> dict[str, torch.nn.Parameter]:
        """Every parameter this rank holds under its HF name, the tied head's copy included."""
        out = {}
        for m in self.modules():
            if isinstance(m, (Embed, Decoder, FinalNorm, LMHead)):
                out.update(m.hf_parameters())
        return out

    def sign_names(self, stage: int) -> list[str]:
        """The HF names whose gradients `stage` corrects, in order: its own, then the tied head's copy
        of the embedding on the last stage (it must move exactly like stage 0's)."""
        names = list(self.hf_names_per_stage()[stage])
        if stage == self.num_stages - 1 and stage > 0 and self.config.tie_word_embeddings:
            names.append("model.embed_tokens.weight")
        return names

    def hf_names_per_stage(self) -> list[list[str]]:
        """HF names each stage owns, derived from the split (the same on every rank)."""
        cfg, out = self.config, []
        layer = 0
        for s, n in enumerate(self.layers_per_stage):
            names = ["model.embed_tokens.weight"] if s == 0 else []
            for i in range(layer, layer + n):
                names += [f"model.layers.{i}.{k}" for k in self._decoder_param_names()]
            layer += n
            if s == len(self.layers_per_stage) - 1:
                names.append("model.norm.weight")
                if not cfg.tie_word_embeddings:
                    names.append("lm_head.weight")
            out.append(names)
        return out

    def _decoder_param_names(self) -> list[str]:
        layer_cls, _, _ = hf_module_classes(self.config)
        with torch.device("meta"):
            return [n for n, _ in layer_cls(self.config, 0).named_parameters()]
