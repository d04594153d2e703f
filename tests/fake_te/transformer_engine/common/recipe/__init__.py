"""TransformerEngine's DelayedScaling recipe, as the fields model/te.py sets."""

from dataclasses import dataclass
from enum import Enum


class Format(Enum):
    E4M3 = "e4m3"
    HYBRID = "hybrid"


@dataclass
class DelayedScaling:
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
