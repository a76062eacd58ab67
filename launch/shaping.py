"""A host's egress shaping in a test cluster (launch/netns.py): netem's model and its units.
Standard library only."""
from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Shaping:
    """One host's egress: delay +- uniform jitter (ms), rate (bits/s, None: unlimited), queue limit (frames)."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    rate_bps: float | None = None
    limit: int = 1000  # netem's default

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.jitter_ms > self.delay_ms:
            raise ValueError(f"need 0 <= jitter_ms <= delay_ms, got delay {self.delay_ms} jitter {self.jitter_ms}")
        if self.rate_bps is not None and self.rate_bps <= 0:
            raise ValueError(f"rate_bps must be > 0, got {self.rate_bps}")
        if self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")

    @property
    def noop(self) -> bool:
        return self.delay_ms == 0 and self.rate_bps is None

    def describe(self) -> str:
        parts = []
        if self.delay_ms:
            parts.append(f"delay {self.delay_ms:g} ms" + (f" +- {self.jitter_ms:g} ms" if self.jitter_ms else ""))
        if self.rate_bps:
            parts.append(f"rate {format_rate(self.rate_bps)}")
        return ", ".join(parts) or "none"

    def netem_args(self) -> list[str]:
        args = ["netem", "limit", str(self.limit)]
        if self.delay_ms:
            args += ["delay", f"{self.delay_ms * 1000:.0f}us"] + ([f"{self.jitter_ms * 1000:.0f}us"] if self.jitter_ms else [])
        if self.rate_bps:
            args += ["rate", f"{self.rate_bps:.0f}bit"]
        return args

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict | None) -> "Shaping | None":
        return None if data is None else cls(**data)


def parse_duration_ms(text: str) -> float:
    """'2ms', '500us', '0.002s' or a bare number of milliseconds."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*(us|ms|s)?\s*", str(text))
    if not m:
        raise ValueError(f"not a duration: {text!r} (e.g. 2ms, 500us)")
    return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3, None: 1.0}[m.group(2)]


def parse_rate(text: str) -> float:
    """'1gbit', '100mbit', '500kbit' or a bare number of bits per second."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*(bit|kbit|mbit|gbit)?\s*", str(text).lower())
    if not m:
        raise ValueError(f"not a rate: {text!r} (e.g. 1gbit, 100mbit)")
    return float(m.group(1)) * {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, None: 1}[m.group(2)]


def format_rate(bps: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"
