# 2026-12-01, research for issue 12 (separate forward/backward wire budgets); see notebooks/research/deepspeed_grad_path.md
import types, torch
from deepspeed.runtime.pipe.engine import PipelineEngine as PE
f = types.SimpleNamespace(_grad_layer_buf=[], num_pipe_buffers=2, device="cpu",
                          fp16_enabled=lambda: False, bfloat16_enabled=lambda: False)
for n in ("_allocate_zeros", "_allocate_buffer", "_allocate_or_extend_buffers"):
    setattr(f, n, getattr(PE, n).__get__(f))
a = f._allocate_or_extend_buffers(0, [2, 4, 22], torch.uint8)    # activation recv idx0 (payload first)
g = f._allocate_or_extend_buffers(0, [2, 4, 6], torch.float16)   # grad recv idx0 (carrier)
print("act", a.dtype, list(a.shape), "grad asked fp16 ->", g.dtype, list(g.shape), g.numel()*g.element_size(), "bytes; shares storage:", g.untyped_storage().data_ptr()==a.untyped_storage().data_ptr())
f._grad_layer_buf = []
a = f._allocate_or_extend_buffers(0, [2, 4, 6], torch.float16)   # carrier first
g = f._allocate_or_extend_buffers(0, [2, 4, 6], torch.float16)
print("carrier-first: act", a.dtype, "grad", g.dtype, "shares storage:", g.untyped_storage().data_ptr()==a.untyped_storage().data_ptr())
