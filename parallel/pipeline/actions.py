"""The steps of a rank's pipeline program: computes (F, B, W) and the transfers between ranks."""

from dataclasses import dataclass

# W: the weight gradients of a backward whose B computed only the input gradient (zero-bubble schedules).
FORWARD, BACKWARD, WEIGHT = "F", "B", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"


@dataclass(frozen=True)
class Action:
    """One step of a rank's program. For transfers, `chunk` is the local chunk that produced (SEND)
    or will consume (RECV) the tensor, and `peer` the other pipeline rank."""

    rank: int
    op: str
    chunk: int
    microbatch: int
    peer: int | None = None

    @property
    def is_compute(self) -> bool:
        return self.op in (FORWARD, BACKWARD, WEIGHT)

    def __str__(self) -> str:
        text = f"r{self.rank} {self.op} c{self.chunk} m{self.microbatch}"
        if self.peer is None:
            return text
        return f"{text} {'->' if self.op.startswith('SEND') else '<-'} r{self.peer}"
