"""Rule-based verifiers → reward in {0, 1}. Never raise on hostile model output.

- `exact_integer`: the synthetic task; the response (up to end-of-sequence) must be exactly the
  integer, nothing else.
- `math_answer`: `math-verify` on the response's last `\\boxed{}` against the reference answer,
  with its own parse and verify time limits (signal based: they work in a main thread only, and
  not inside one long C call; the trainer calls it through math_verifier.MathVerifier, whose
  helper process gives the hard limit).
"""
import re

_INT = re.compile(r"^-?\d+$")


def exact_integer(response: str, answer: str) -> float:
    text = response.strip()
    if len(text) > 64 or not _INT.match(text):   # int() of a huge digit string raises
        return 0.0
    return float(int(text) == int(answer))


def exact_integers(responses: list[str], answers: list[str]) -> list[float]:
    return [exact_integer(r, a) for r, a in zip(responses, answers)]


def math_answer(response: str, answer: str, timeout_s: int | None = 5) -> float:
    """`timeout_s`: math-verify's own limit on parse and on verify, whole seconds; None: off."""
    from math_verify import parse, verify
    try:
        gold = parse(f"${answer}$" if "\\boxed" not in answer else answer, parsing_timeout=timeout_s)
        pred = parse(response, parsing_timeout=timeout_s)
        return float(bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=timeout_s))
    except Exception:  # a verifier must not take the run down on a strange string
        return 0.0
