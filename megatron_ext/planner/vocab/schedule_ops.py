"""Pass vocabulary of the vocabulary-parallel 1F1B schedule, and the 1F1B skeleton.

Pure Python (no torch); the 1F1B order itself is planner/cost/pipeline.py's one_f_one_b_order.
Micro-batches are 0-based; stages are pipeline ranks; every tensor-parallel rank of a stage runs
the same pass order.

Transformer passes and their P2P calls follow Megatron-Core's
`forward_backward_pipelining_without_interleaving` call for call, so the P2P pairing between
neighbours is Megatron's; the only change is `extra_warmup` more warm-up forwards on every stage
(1 for the 1-barrier algorithm, 2 for the 2-barrier one), which is where the paper's
p+1 / p+2 activation memory comes from (section 6.2 of the reference notes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_ext.planner.cost.pipeline import num_warmup, one_f_one_b_order

OpKind = Literal[
    "RF", "F", "SF", "SFRB", "B", "SBRF", "RB", "SB",  # transformer passes and Megatron's P2P
    "IF", "IB", "S", "L", "T",  # vocabulary passes
]
P2P_KINDS = frozenset({"RF", "SF", "SFRB", "SBRF", "RB", "SB"})
VOCAB_KINDS = ("IF", "IB", "S", "L", "T")


@dataclass(frozen=True, kw_only=True, slots=True)
class Op:
    """One pass or P2P call of one stage.

    RF j / SF j / RB j / SB j: receive/send activation (F) or gradient (B) of micro-batch j.
    SFRB j k: send activation j, receive gradient k (one batched call); SBRF k j the reverse.
    F j / B j: transformer forward / backward. IF j / IB j: input-embedding forward / backward.
    S j: output-layer forward (+ fused input-gradient GEMMs). L j: loss and token gradients
    (last stage only). T j: output-layer weight gradient (+ input-gradient GEMM, 2 barriers)."""

    kind: OpKind
    """What runs."""
    mb: int
    """Micro-batch (for SFRB/SBRF: the one sent)."""
    recv_mb: int = -1
    """SFRB/SBRF only: the micro-batch received."""

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f"/{self.recv_mb}" if self.recv_mb >= 0 else "")

    def received(self) -> tuple[str, int] | None:
        """("act" | "grad", micro-batch) this call receives, if any."""
        if self.kind == "RF":
            return "act", self.mb
        if self.kind == "RB":
            return "grad", self.mb
        if self.kind == "SFRB":
            return "grad", self.recv_mb
        if self.kind == "SBRF":
            return "act", self.recv_mb
        return None

    def sent(self) -> tuple[str, int] | None:
        """("act" | "grad", micro-batch) this call sends, if any."""
        if self.kind in ("SF", "SFRB"):
            return "act", self.mb
        if self.kind in ("SB", "SBRF"):
            return "grad", self.mb
        return None


def receive_window(num_stages: int, num_barriers: int) -> int:
    """Broadcast receives (X, g, the embedding gradient) a rank keeps posted ahead, per kind.

    A rank posts receive j + window when it consumes receive j, so at most `window` receive
    buffers of a kind exist at once (posting all M up front would hold M [s, b, h] buffers on a
    device). The simulation (schedule_sim.py) models exactly this, so a schedule it accepts
    cannot deadlock on a late receive; p + barriers + 2 covers the micro-batches in flight
    (p + barriers) with two to spare."""
    return num_stages + num_barriers + 2


def skeleton_1f1b(
    stage: int,
    num_stages: int,
    num_microbatches: int,
    *,
    extra_warmup: int = 0,
    forward_only: bool = False,
) -> list[Op]:
    """Transformer passes and P2P calls of one stage, in Megatron 1F1B order.

    Calls with no peer (receive on the first stage, send from the last) are left out."""
    first, last = stage == 0, stage == num_stages - 1
    m = num_microbatches
    if forward_only:
        ops: list[Op] = []
        for j in range(m):
            ops += ([] if first else [Op(kind="RF", mb=j)]) + [Op(kind="F", mb=j)]
            ops += [] if last else [Op(kind="SF", mb=j)]
        return ops
    warm = num_warmup(stage, num_stages, m, extra_warmup)
    order = one_f_one_b_order(stage, num_stages, m, extra_warmup)
    steady_end = warm + 2 * (m - warm)  # order[warm:steady_end] alternates F, B
    ops = []
    for pos, (kind, j) in enumerate(order):
        if pos < warm:  # warm-up forward
            ops += ([] if first else [Op(kind="RF", mb=j)]) + [Op(kind="F", mb=j)]
            ops += [] if last else [Op(kind="SF", mb=j)]
        elif pos >= steady_end:  # cool-down backward
            ops += ([] if last else [Op(kind="RB", mb=j)]) + [Op(kind="B", mb=j)]
            ops += [] if first else [Op(kind="SB", mb=j)]
        elif kind == "F":  # steady forward: send it, receive the gradient of the next B
            if pos == warm and not first:
                ops.append(Op(kind="RF", mb=j))
            ops.append(Op(kind="F", mb=j))
            ops += [] if last else [Op(kind="SFRB", mb=j, recv_mb=order[pos + 1][1])]
        else:  # steady backward: send it, receive the input of the next forward
            ops.append(Op(kind="B", mb=j))
            nxt = order[pos - 1][1] + 1
            if not first:
                ops.append(Op(kind="SB", mb=j) if nxt >= m else Op(kind="SBRF", mb=j, recv_mb=nxt))
    return ops
