"""Alignment strategies (:class:`Strategy`): how a query token is aligned to document tokens, named by strings
such as "top-k:1", "top-p:0.015" or "da:4:0.04".

A strategy string is parsed once where it enters (the ``--strategy`` argparse type, the manifest reader, the public
constructors of searchers and trainers); everything inward takes a :class:`Strategy`. Kept free of torch: the
manifest reader uses it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

_FORMS = "'top-k:K' (integer K >= 1), 'top-p:P' (0 < P <= 1) or 'da:K:EPS' (K > 0, EPS > 0)"


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


@dataclass(frozen=True)
class Strategy:
    """Alignment strategy: kind "top-k" (uses k), "top-p" (uses p) or "da" (uses k and eps)."""

    kind: str
    k: float = 1.0
    p: float = 0.0
    eps: float = 0.0

    def __post_init__(self) -> None:
        for name in ("k", "p", "eps"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"strategy {name} must be finite, got {getattr(self, name)}")
        if self.kind == "top-k":
            if self.k < 1 or not float(self.k).is_integer():
                raise ValueError(f"top-k needs an integer k >= 1, got {self.k}")
        elif self.kind == "top-p":
            if not 0.0 < self.p <= 1.0:
                raise ValueError(f"top-p needs 0 < p <= 1, got {self.p}")
        elif self.kind == "da":
            if not (self.k > 0 and self.eps > 0):
                raise ValueError(f"da needs k > 0 and eps > 0, got k={self.k}, eps={self.eps}")
        else:
            raise ValueError(f"strategy kind must be 'top-k', 'top-p' or 'da', got {self.kind!r}")

    def __str__(self) -> str:
        if self.kind == "top-k":
            return f"top-k:{_fmt(self.k)}"
        if self.kind == "top-p":
            return f"top-p:{_fmt(self.p)}"
        return f"da:{_fmt(self.k)}:{_fmt(self.eps)}"


MAXSIM = Strategy("top-k", k=1)  # top-k:1: each query token's single best document token


def parse_strategy(spec: str | Strategy) -> Strategy:
    """Strategy from "top-k:1", "top-p:0.015" or "da:4:0.04" (a Strategy is returned as is)."""
    if isinstance(spec, Strategy):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"alignment strategy must be a string, got {type(spec).__name__}; expected {_FORMS}")
    parts = spec.strip().split(":")
    n_args = {"top-k": 1, "top-p": 1, "da": 2}.get(parts[0])
    if n_args is None or len(parts) != n_args + 1:
        raise ValueError(f"bad alignment strategy {spec!r}; expected {_FORMS}")
    try:
        nums = [float(v) for v in parts[1:]]
        if parts[0] == "top-k":
            return Strategy("top-k", k=nums[0])
        if parts[0] == "top-p":
            return Strategy("top-p", p=nums[0])
        return Strategy("da", k=nums[0], eps=nums[1])
    except ValueError as err:
        raise ValueError(f"bad alignment strategy {spec!r} ({err}); expected {_FORMS}") from None


def as_strategy(value: str | Strategy) -> Strategy:
    """The ``strategy`` argument of a public constructor (a Strategy, or its string) as a Strategy; its one
    coercion, raising ValueError "strategy: ..."."""
    try:
        return parse_strategy(value)
    except ValueError as error:
        raise ValueError(f"strategy: {error}") from None
