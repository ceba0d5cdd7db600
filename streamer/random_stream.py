"""Counter-based uniforms: one draw per (key, position), a pure function of the two.

A seeded request must draw the same tokens however it is batched, wherever it is resumed, on
whichever worker. A stateful generator per row gives that only by being rebuilt for every row
at every step; hashing the (key, position) counter gives it for a whole batch in a few tensor
operations.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_POSITION_SALT = 0x9E3779B9  # keeps position 0 from hashing to 0


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), in int64 without overflow: c in 16-bit halves."""
    hi, lo = c >> 16, c & 0xFFFF
    return ((((x * hi) & 0xFFFF) << 16) + x * lo) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A full-avalanche 32-bit hash (C. Wellons' "lowbias32" constants)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniforms(keys: list[int], positions: list[int], device: torch.device) -> torch.Tensor:
    """One float32 in (0, 1] per (key, position) pair, on `device`.

    Open at 0 so an inverse-CDF draw can never land on a token of weight zero; 24 bits, all
    that a float32 in [0.5, 1) holds."""
    keys64 = [k & _M64 for k in keys]
    lo = torch.tensor([k & _M32 for k in keys64], dtype=torch.int64, device=device)
    hi = torch.tensor([k >> 32 for k in keys64], dtype=torch.int64, device=device)
    pos = torch.tensor([p & _M32 for p in positions], dtype=torch.int64, device=device)
    h = _mix32(_mix32(_mix32(pos ^ _POSITION_SALT) ^ hi) ^ lo)
    return ((h >> 8) + 1).to(torch.float32) * 2.0**-24


def generator_uniforms(n: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """`n` float32 in (0, 1] from a stateful generator (rows without a seed), on `device`."""
    return (1.0 - torch.rand(n, generator=generator, device=generator.device)).to(device)
