"""The codec's geometry, one formula each: how many channels a cut keeps, where the cuts sit.

Pure Python (no torch), so the config checks use the same formulas as the code that runs.

    k     = keep                      when keep > 0
          = round(keep_ratio · d)     otherwise (77 of 1536 at the default 0.05)
    cut b sits after decoder layer  Σ_{s ≤ b} layers_per_stage[s] − 1   (between stage b and b+1)
    rotated levels: "uniform", or "gauss" (scaled by each tile's RMS: needs tiles, ≤ 4 bits)
"""


def keep_count(keep: int, keep_ratio: float, d: int) -> int:
    """k kept channels per token (may be out of [1, d]: the caller checks and names its key)."""
    return keep if keep > 0 else round(keep_ratio * d)


def cut_layers(layers_per_stage: list[int]) -> list[int]:
    """Decoder layer index after which each cut sits, boundary b after stage b."""
    out, acc = [], 0
    for n in layers_per_stage[:-1]:
        acc += n
        out.append(acc - 1)
    return out


def compressed_cuts(boundaries, layers_per_stage: list[int]) -> list[int]:
    """The cuts a codec compresses: `boundaries` is "all" or a list of cut layers."""
    return cut_layers(layers_per_stage) if boundaries == "all" else list(boundaries)


def levels_problem(levels: str, tile: int, bits: int) -> str | None:
    """Why a rotated code's levels do not fit its tile and bits, or None (the Lloyd–Max table stops at
    4 bits, and Gaussian levels are scaled by a tile's RMS, so they need tiles)."""
    if levels == "uniform" or (levels == "gauss" and tile > 0 and bits <= 4):
        return None
    return "expected 'uniform', or 'gauss' with a tile > 0 and at most 4 bits"
