"""What random JSON values do the fuzz tests send, for HTTP bodies and socket frames alike?

:class:`FuzzValues` draws one value from a seeded ``random.Random``: the scalars every
fuzz sends (null, booleans, edge integers, floats, odd unicode), then the scalars its
test adds, then, above ``max_depth``, a list or (twice as likely) an object built by
the test. The order of the draws is part of the contract: a seed names the same
sequence of values it always did (POOLD_FUZZ_SEED reproduces a failure).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Scalar = Callable[[random.Random], Any]


def _none(rng: random.Random) -> Any:
    return None


def _bool(rng: random.Random) -> Any:
    return rng.choice([True, False])


def _int(rng: random.Random) -> Any:
    return rng.choice([0, -1, 1, 2**31, 2**63, -(2**63), 10**30, 4096, 1 << 30])


def _float(rng: random.Random) -> Any:
    return rng.random() * rng.choice([1, 1e300, -1])


def _unicode(rng: random.Random) -> Any:
    return "".join(chr(rng.randrange(1, 0x2FFF)) for _ in range(rng.randrange(12)))


COMMON: tuple[Scalar, ...] = (_none, _bool, _int, _float, _unicode)


@dataclass(frozen=True)
class FuzzValues:
    """A seeded generator of JSON-ish values; ``obj(rng, depth)`` builds the test's objects."""

    scalars: Sequence[Scalar]  # drawn after COMMON
    obj: Callable[[random.Random, int], Any]  # at `depth`; recurse with depth + 1
    max_depth: int = 3  # from this depth on, scalars only

    def __call__(self, rng: random.Random, depth: int = 0) -> Any:
        scalars = (*COMMON, *self.scalars)
        kind = rng.randrange(len(scalars) + 3 if depth < self.max_depth else len(scalars))
        if kind < len(scalars):
            return scalars[kind](rng)
        if kind == len(scalars):
            return [self(rng, depth + 1) for _ in range(rng.randrange(4))]
        return self.obj(rng, depth)
