"""What a calibration run measures: `Settings`, and its quick form for tests and smoke checks."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    gpu: str
    """GPU type the profile is for (a key of `cost.hardware.GPUS`)."""
    model: str
    """Model preset whose layer shape the linear part is timed with."""
    cluster: str = "cpu"
    """Cluster preset giving the nominal NIC rate (efficiencies are fractions of it)."""
    max_length: int = 8192
    pack_tokens: int = 16384
    linear_tokens: tuple[int, ...] = (64, 256, 1024, 4096, 16384)
    message_bytes: tuple[int, ...] = tuple(2**k for k in range(10, 25, 2))
    repeats: int = 5


def quick(settings: Settings) -> Settings:
    """A run of seconds (tests, smoke checks): short lengths, few sizes, 2 repeats."""
    return dataclasses.replace(settings, max_length=min(settings.max_length, 512), pack_tokens=1024,
                               linear_tokens=(64, 512), message_bytes=(2**10, 2**16, 2**20), repeats=2)

