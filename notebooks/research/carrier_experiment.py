# 2026-12-01, research for issue 12 (separate forward/backward wire budgets); see notebooks/research/deepspeed_grad_path.md
# 2-stage CPU/gloo check: (carrier fp16, payload uint8, rows int32) across a cut, bit-exactness both ways.
import os, json, torch, deepspeed
from deepspeed.pipe import PipelineModule, LayerSpec
from deepspeed.runtime.pipe import p2p
deepspeed.init_distributed(dist_backend="gloo")
rank = int(os.environ["RANK"])
B, T, D = 2, 4, 8
# fwd / bwd bit patterns for the fp16 carrier, with NaN, sNaN, inf, -0, denormal
SPECIAL = [0x7C01, 0x7E00, 0xFFFF, 0x7C00, 0x8000, 0x0001, 0x3C00, 0xFC01]
def bits(seed, shape):
    g = torch.Generator().manual_seed(seed)
    v = torch.randint(0, 1 << 16, shape, generator=g, dtype=torch.int32)
    flat = v.view(-1); flat[:len(SPECIAL)] = torch.tensor(SPECIAL)
    return (v - (1 << 16) * (v >= (1 << 15)).int()).to(torch.int16)   # to signed int16
FWD_BITS, BWD_BITS = bits(1, (B, T, 6)), bits(2, (B, T, 6))
PAYLOAD = torch.randint(0, 256, (B, T, 22), generator=torch.Generator().manual_seed(3), dtype=torch.int32).to(torch.uint8)
log = {"send": [], "enc_bwd": [], "dec_fwd": []}

class EncFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        ctx.shape = h.shape
        payload = PAYLOAD.clone(); ctx.mark_non_differentiable(payload)
        return FWD_BITS.clone().view(torch.float16), payload
    @staticmethod
    def backward(ctx, g_carrier, g_payload):
        log["enc_bwd"].append(dict(shape=list(g_carrier.shape), dtype=str(g_carrier.dtype),
                                   bits_exact=bool(torch.equal(g_carrier.contiguous().view(torch.int16), BWD_BITS)),
                                   g_payload_none=g_payload is None))
        return torch.ones(ctx.shape)

class DecFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, carrier, payload):
        ctx.save_for_backward(carrier)
        return payload[..., :D].float()
    @staticmethod
    def backward(ctx, gy):
        (carrier,) = ctx.saved_tensors
        return BWD_BITS.clone().view(torch.float16), None

class Enc(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.lin = torch.nn.Linear(D, D)
    def forward(self, x):
        carrier, payload = EncFn.apply(self.lin(x))
        rows = torch.arange(B * 3, dtype=torch.int32).view(B, 3)
        return carrier, payload, rows

class Dec(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.w = torch.nn.Parameter(torch.ones(1))
    def forward(self, inp):
        carrier, payload, rows = inp
        log["dec_fwd"].append(dict(dtypes=[str(t.dtype) for t in inp], req=[t.requires_grad for t in inp],
                                   carrier_bits_exact=bool(torch.equal(carrier.view(torch.int16), FWD_BITS)),
                                   payload_exact=bool(torch.equal(payload, PAYLOAD)),
                                   rows_exact=bool(torch.equal(rows, torch.arange(B * 3, dtype=torch.int32).view(B, 3)))))
        return DecFn.apply(carrier, payload) * self.w

inner = p2p.send
def send(t, dest, async_op=False):
    log["send"].append((rank, dest, str(t.dtype), list(t.shape), t.numel() * t.element_size()))
    return inner(t, dest, async_op=async_op)
p2p.send = send

net = PipelineModule(layers=[LayerSpec(Enc), LayerSpec(Dec)], num_stages=2,
                     loss_fn=lambda out, lab: out.mean(), partition_method="uniform")
cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
       "steps_per_print": 1000}
eng, _, _, _ = deepspeed.initialize(model=net, config=cfg,
                                    optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
                                    model_parameters=[p for p in net.parameters()])
def it():
    while True:
        yield torch.randn(B, T, D), torch.zeros(B)
log["send"].clear()
loss = eng.train_batch(it())
if rank == 0:
    log["stage0_lin_grad_nonzero"] = None
out = {"rank": rank, "loss": float(loss), **log}
if rank == 1:
    # inputs the receiver keeps: grads of non-floats? check a fresh manual leaf
    pass
print("RESULT", json.dumps(out), flush=True)
