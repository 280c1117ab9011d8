"""One step's metrics across the world: partial sums per rank → one dict on rank 0 → the logged values.

Every rank builds its partial sums as one flat dict with the same keys on every rank (zeros where it
holds nothing: only the last stage has losses, each stage its own slot of the per-stage keys);
`sum_to_rank0` gathers the dicts to global rank 0 and adds them up in rank order, key by key, so no
value depends on where it sits in a vector or on the collective's summation order. The `finish`
functions turn the sums into the logged metrics (named as in docs/metrics.md). A partial that is not itself a
metric has a name part that starts with "_".

    losses      actor/{pg_loss, kl_loss, ppo_kl, pg_clipfrac(_lower, _dual), entropy}: token-mean sums
    mismatch    rollout_corr/{kl, k3_kl, prob_diff_mean, logp_diff_mean} sums and the moments behind the Pearson
                (health.py); with prefix probe/ for the codec-off probe; on probe steps mismatch/{numerics,
                codec}_{kl, logp_diff}, the gap by source (health.mismatch_split)
    rollout IS  with grpo.rollout_correction: rollout_corr/{rollout_is_mean, _is_sq, rollout_is_ratio_fraction_high,
                rollout_rs_masked_fraction} sums; rollout_corr/_is_max_dp{r}, replica r's largest weight
    clipped     actor/_stepped_sq/{i}: Σ g² of optimizer step i's gradient after the clip (grads.SteppedNorm)
    correction  anchor/_agree, anchor/_numel; grad/_cd, _cc, _dd (before the correction), _kd, _kk (after)
    movement    weights/_d2, _b2, _pb, _p2 /stage{s}: Σ(θ−θ₀)², Σθ₀², Σθ·θ₀, Σθ²   (data-parallel rank 0)
    wire        codec/_fwd, _bwd, _pay, _dense, _pay_train, _dense_train, _fwd32, _bwd32 /stage{s}: p2p
                bytes sent by direction, the codec payload with its dense size over all passes, over
                the update passes only (the only ones with a backward) the payloads' gradients with
                their dense size, and the fp32 tensors' bytes by direction; probe/_bytes_fwd
    memory      memory/peak_rss_mib/stage{s}: the stage's process's peak resident memory so far
                (data-parallel rank 0; a machine's reading, not a result: identity checks skip it)
"""
import resource
import sys
import zlib

import torch

from ..grpo.advantages import zero_advantage_groups
from ..grpo.rollout_correction import effective_sample_size
from .health import finish_mismatch
from ..pipeline import comm

LOSSES = ["actor/pg_loss", "actor/kl_loss", "actor/ppo_kl", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
          "actor/pg_clipfrac_below", "actor/entropy"]   # actor/kl_loss only at β > 0
# off-policy steps (several PPO mini-batches or epochs): the first update's Σ w·|log ρ|, exactly 0 when
# its train pass reproduces the old-policy pass (same weights, same codec keys)
FIRST_RATIO = "actor/first_update_abs_log_ratio"
MOVEMENT = ("_d2", "_b2", "_pb", "_p2")
# the update passes' token slots: computed, at one padded length, passes trimmed (pipeline/passes.py)
SLOTS = ["pipeline/token_slots", "pipeline/padded_slots", "pipeline/trimmed_passes"]
WIRE = ("_fwd", "_bwd", "_pay", "_dense", "_pay_train", "_dense_train", "_fwd32", "_bwd32")
CORRECTION = ["anchor/_agree", "anchor/_numel", "grad/_cd", "grad/_cc", "grad/_dd", "grad/_kd", "grad/_kk"]


def sum_to_rank0(partials: dict[str, float]) -> dict[str, float] | None:
    """Σ over ranks of each partial, in rank order, on global rank 0; None elsewhere."""
    keys = sorted(partials)
    # the key list's checksum travels last: a rank with other keys is an error, not a silent mix-up
    vec = torch.tensor([float(partials[k]) for k in keys] + [float(zlib.crc32("\n".join(keys).encode()))],
                       dtype=torch.float64)
    rows = comm.gather_to_rank0(vec)
    if rows is None:
        return None
    assert all(r[-1] == vec[-1] for r in rows), "ranks reported different metric keys"
    total = torch.zeros_like(vec)
    for r in rows:
        total += r
    return dict(zip(keys, total[:-1].tolist()))


def owned(keys: list[str], values: dict | None) -> dict[str, float]:
    """`keys` as floats from `values` on the rank that holds them (values given), zeros elsewhere."""
    return {k: float(values[k]) if values is not None else 0.0 for k in keys}


def per_stage(names, stage: int, num_stages: int, prefix: str, values) -> dict[str, float]:
    """`prefix/name/stage{s}` for every stage s: `values` at this stage's slot, 0 at the others'."""
    return {f"{prefix}/{n}/stage{s}": (float(v) if s == stage else 0.0)
            for s in range(num_stages) for n, v in zip(names, values)}


def per_replica(name: str, dp_rank: int, dp: int, value: float) -> dict[str, float]:
    """`name_dp{r}` for every data-parallel replica r: `value` at this replica's slot, 0 at the others'
    (a maximum over replicas is read from the slots: the sum keeps each)."""
    return {f"{name}_dp{r}": (float(value) if r == dp_rank else 0.0) for r in range(dp)}


def finish_rollout_correction(r: dict[str, float]) -> dict[str, float]:
    """The rollout correction's logged values: the weights' mean, max and effective sample size (verl's
    names), the share of ratios above C and the share rejected."""
    if "rollout_corr/_is_sq" not in r:
        return {}
    mean = r["rollout_corr/rollout_is_mean"]
    return {"rollout_corr/rollout_is_mean": mean,
            "rollout_corr/rollout_is_max": max(v for k, v in r.items() if k.startswith("rollout_corr/_is_max_dp")),
            "rollout_corr/rollout_is_eff_sample_size": effective_sample_size(mean, r["rollout_corr/_is_sq"]),
            "rollout_corr/rollout_is_ratio_fraction_high": r["rollout_corr/rollout_is_ratio_fraction_high"],
            "rollout_corr/rollout_rs_masked_fraction": r["rollout_corr/rollout_rs_masked_fraction"]}


def peak_rss_mib() -> float:
    """This process's peak resident set size since it started, MiB (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def movement_partials(params, base, stage: int, num_stages: int, counted: bool) -> dict[str, float]:
    """Σ(θ−θ₀)², Σθ₀², Σθ·θ₀, Σθ² over this stage's parameters (one replica counts them)."""
    v = torch.zeros(4, dtype=torch.float64)
    if counted:
        for p, b in zip(params, base):
            p, b = p.detach().double(), b.double()
            v = v.to(p.device) + torch.stack([(p - b).pow(2).sum(), b.pow(2).sum(), (p * b).sum(), p.pow(2).sum()])
    return per_stage(MOVEMENT, stage, num_stages, "weights", v.tolist())


def finish_movement(r: dict[str, float], num_stages: int) -> dict[str, float]:
    out = {}
    for s in range(num_stages):
        d2, b2, pb, p2 = (r[f"weights/{n}/stage{s}"] for n in MOVEMENT)
        out[f"weights/rel_change/stage{s}"] = (d2 / b2) ** 0.5
        out[f"weights/cos_base/stage{s}"] = pb / (p2 * b2) ** 0.5
    return out


def finish_wire(r: dict[str, float], num_stages: int) -> dict[str, float]:
    """Wire bytes per direction, what a dense pipeline would have sent (the same sends with each
    compressed payload, and on the update passes its gradient, at its dense size), and what these
    sends cost in a bf16 pipeline (every fp32 tensor at half its bytes, codes and integers as sent)."""
    tot = {n: 0.0 for n in WIRE}
    for s in range(num_stages):
        for n in WIRE:
            tot[n] += r[f"codec/{n}/stage{s}"]
    out = {"codec/bytes_fwd": tot["_fwd"], "codec/bytes_bwd": tot["_bwd"],
           "codec/dense_equiv_bytes": tot["_fwd"] - tot["_pay"] + tot["_dense"],
           "codec/dense_equiv_bytes_bwd": tot["_bwd"] - tot["_pay_train"] + tot["_dense_train"],
           "codec/bytes_fwd_bf16": tot["_fwd"] - tot["_fwd32"] / 2, "codec/bytes_bwd_bf16": tot["_bwd"] - tot["_bwd32"] / 2}
    for b in range(num_stages - 1):
        out[f"codec/boundary{b}/bytes_fwd"] = r[f"codec/_fwd/stage{b}"]
        out[f"codec/boundary{b}/bytes_bwd"] = r[f"codec/_bwd/stage{b + 1}"]
    return out


def stepped_partials(sq: list[float], updates: int) -> dict[str, float]:
    """This rank's Σ g² after the clip of each of the step's `updates` optimizer steps (a skipped
    step records none: the trainer logs NaN then). More entries than steps (an optimizer stepping
    several parameter groups one by one) cannot be assigned to steps: NaN, not a wrong number."""
    if len(sq) > updates:
        return {f"actor/_stepped_sq/{i}": float("nan") for i in range(updates)}
    return {f"actor/_stepped_sq/{i}": sq[i] if i < len(sq) else 0.0 for i in range(updates)}


def finish_stepped(r: dict[str, float]) -> dict[str, float]:
    """actor/grad_norm_clipped: the global norm of the gradient the optimizer steps from, after the
    clip and before the anchor's sign correction, mean over the step's optimizer steps; with one
    optimizer step per rollout step, min(actor/grad_norm, gradient_clipping)."""
    sq = [v for k, v in r.items() if k.startswith("actor/_stepped_sq/")]
    return {"actor/grad_norm_clipped": sum(v ** 0.5 for v in sq) / len(sq)} if sq else {}


def correction_partials(agreement, before, after) -> dict[str, float]:
    """The sign correction's agreement counts and the probe's dot products (grads.GradientComparison)."""
    return dict(zip(CORRECTION, [float(agreement.agree) if agreement else 0.0,
                                 float(agreement.numel) if agreement else 0.0, *before.tolist(), *after.tolist()]))


def finish_correction(r: dict[str, float], compared: bool) -> dict[str, float]:
    """anchor/sign_agreement (when a sign is held) and, on compared steps, the gradient cosines."""
    agree, n, cd, cc, dd, kd, kk = (r[k] for k in CORRECTION)
    out = {"anchor/sign_agreement": agree / n} if n > 0 else {}
    if compared and cc > 0 and dd > 0:
        out["grad/cos_comp_dense"] = cd / (cc * dd) ** 0.5
        out["grad/cos_corrected_dense"] = kd / (kk * dd) ** 0.5
    return out


def finish(r: dict[str, float], num_stages: int, probed: bool, compared: bool) -> dict[str, float]:
    """The logged metrics of a step from the summed partials (probe keys on probe steps)."""
    out = {k: r[k] for k in LOSSES + [FIRST_RATIO] if k in r}
    correction = finish_rollout_correction(r)
    out.update(finish_mismatch({k: v for k, v in r.items() if k.startswith("rollout_corr/") and k not in correction
                                and not k.startswith("rollout_corr/_is_")}))
    out.update(correction)
    if probed:
        out.update({k: v for k, v in r.items() if k.startswith("mismatch/")})
        probe = {k[len("probe/"):]: v for k, v in r.items() if k.startswith("probe/") and k != "probe/_bytes_fwd"}
        out.update({"probe/" + k: v for k, v in finish_mismatch(probe).items()})
        out["probe/bytes_fwd"] = r["probe/_bytes_fwd"]
    out.update(finish_correction(r, compared))
    out.update(finish_stepped(r))
    out.update(finish_movement(r, num_stages))
    out.update(finish_wire(r, num_stages))
    out.update({k: v for k, v in r.items() if k.startswith("memory/") or k in SLOTS})
    return out


def group_shares(rewards_N: torch.Tensor, group_size: int, skipping: bool) -> dict[str, float]:
    """The share of the step's groups whose rewards are all equal (advantage 0), and of those left
    out of the update (grpo.skip_zero_advantage)."""
    share = float(zero_advantage_groups(rewards_N, group_size).float().mean())
    return {"train/zero_advantage_groups": share, **({"train/skipped_groups": share} if skipping else {})}


def reference_bytes(ref_NT1: torch.Tensor | None, resp_NT1: torch.Tensor) -> dict[str, float]:
    """The reference log-probs' bytes from the sampler's rank to the last stage(s): one float32 per
    response token; nothing where the pipeline computes them."""
    return {} if ref_NT1 is None else {"codec/bytes_ref_logprobs": 4.0 * float((resp_NT1 > 0).sum())}
