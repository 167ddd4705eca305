"""Discrete-event simulation of pipeline pass orders (pure Python, no torch).

`simulate` replays fixed per-stage orders of transformer passes, Megatron's P2P calls and the
vocabulary passes with given costs, modelling every wait the runtime has: P2P calls are
rendezvous (a gloo or NCCL send completes once the peer posts its receive), collectives of one
kind complete in order once every stage has posted (a broadcast also needs every stage's
receive, which the runtime posts `receive_window` micro-batches ahead: receive j when it consumes
receive j - window), and compute passes wait for their inputs. An order the
simulation completes is acyclic as a dependency graph, so it cannot deadlock at run time
whatever the real pass durations are; a cyclic one raises RuntimeError.
`simulate_baseline` replays Megatron's plain 1F1B, for predictions.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass

from megatron_ext.planner.vocab.schedule_ops import Op, receive_window, skeleton_1f1b


@dataclass(frozen=True, kw_only=True, slots=True)
class PassCosts:
    """Durations of one micro-batch's passes (any consistent unit; seconds in predictions)."""

    forward_s: tuple[float, ...]
    """Transformer forward per stage (baseline: including its embedding / output layer)."""
    backward_s: tuple[float, ...]
    """Transformer backward per stage (baseline: including its embedding / output layer)."""
    output_forward_s: float = 0.0
    """S pass on every rank (logits GEMM, stats, fused input-gradient GEMM)."""
    output_backward_s: float = 0.0
    """T pass on every rank (weight-gradient GEMM; + input-gradient GEMM with 2 barriers)."""
    loss_s: float = 0.0
    """L pass on the last stage."""
    input_forward_s: float = 0.0
    """IF pass on every rank."""
    input_backward_s: float = 0.0
    """IB pass on every rank."""
    p2p_s: float = 0.0
    """One activation or gradient message between neighbouring stages."""
    broadcast_s: float = 0.0
    """Broadcast of X [s, b, h] or of the embedding gradient over the vocabulary group."""
    all_gather_s: float = 0.0
    """All-gather of the per-token stats (and the small token-gradient broadcast)."""
    all_reduce_s: float = 0.0
    """All-reduce of [s, b, h] (input gradient, summed embedding) over the vocabulary group."""

    def __post_init__(self) -> None:
        if len(self.forward_s) != len(self.backward_s) or not self.forward_s:
            raise ValueError("forward_s and backward_s need one entry per stage")


@dataclass(frozen=True, kw_only=True, slots=True)
class TimedOp:
    op: Op
    start_s: float
    end_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeline:
    """A simulated (or planned) iteration."""

    stages: tuple[tuple[TimedOp, ...], ...]
    """Per stage, its passes in execution order with simulated times."""

    @property
    def makespan_s(self) -> float:
        return max(s[-1].end_s for s in self.stages if s)

    def order(self, stage: int) -> list[Op]:
        return [t.op for t in self.stages[stage]]

    def busy_s(self, stage: int) -> float:
        """Compute time of a stage (P2P calls excluded)."""
        return sum(t.end_s - t.start_s for t in self.stages[stage] if t.op.kind in _COMPUTE)

    def peak_output_states(self, stage: int) -> int:
        """Most micro-batches whose output-layer S state ([n, v] softmax) a stage holds at once
        (S done, T not yet): the vocabulary passes' activation memory."""
        live = peak = 0
        for t in self.stages[stage]:
            live += (t.op.kind == "S") - (t.op.kind == "T")
            peak = max(peak, live)
        return peak

    def peak_in_flight(self, stage: int) -> int:
        """Most micro-batches whose activations a stage holds at once (forwards minus backwards)."""
        live = peak = 0
        for t in self.stages[stage]:
            live += (t.op.kind == "F") - (t.op.kind == "B")
            peak = max(peak, live)
        return peak


_COMPUTE = frozenset({"F", "B", "IF", "IB", "S", "L", "T"})


def simulate(
    orders: list[list[Op]], costs: PassCosts, *, num_barriers: int = 1, vocab: bool = True,
    forward_only: bool = False,
) -> Timeline:
    """Replay fixed per-stage orders; raises RuntimeError if they deadlock."""
    return _Engine(orders, costs, vocab=vocab, barriers=num_barriers,
                   forward_only=forward_only).run()


def simulate_baseline(num_stages: int, num_microbatches: int, costs: PassCosts) -> Timeline:
    """Megatron's 1F1B with the vocabulary layers inside the first / last stage's costs."""
    orders = [skeleton_1f1b(r, num_stages, num_microbatches) for r in range(num_stages)]
    return simulate(orders, costs, vocab=False)


class _Engine:
    """Discrete-event simulation; stages advance in time order so 'arrived by t' is decidable."""

    def __init__(self, orders: list[list[Op]], costs: PassCosts, *, vocab: bool, barriers: int,
                 forward_only: bool) -> None:
        p = len(orders)
        if len(costs.forward_s) != p:
            raise ValueError(f"costs have {len(costs.forward_s)} stages, schedule has {p}")
        self.p, self.c, self.vocab, self.barriers = p, costs, vocab, barriers
        self.fwd_only = forward_only
        self.todo = [deque(order) for order in orders]
        self.t = [0.0] * p
        self.out: list[list[TimedOp]] = [[] for _ in range(p)]
        self.pending: list[Op | None] = [None] * p
        self.done: dict[tuple[int, str, int], float] = {}  # (stage, kind, mb) -> end
        self.posts: dict[tuple, dict[int | str, float]] = {}
        self.coll_end: dict[tuple[str, int], float] = {}
        self.window = receive_window(p, barriers)
        for kind in _BROADCASTS if vocab else ():  # receives posted at the start
            for j in range(self.window):
                for r in range(p):
                    self._post((kind, j), f"recv{r}", 0.0)

    # ---- main loop ----------------------------------------------------------------------------

    def run(self) -> Timeline:
        """Orders are fixed, so start times follow from dependencies alone: each stage runs
        ahead until it blocks, and blocked stages are re-examined only when all are blocked."""
        while True:
            progressed = False
            for r in range(self.p):
                while self.pending[r] is None and self.todo[r]:
                    self._commit(r, self.todo[r].popleft())
                    self._try_finish(r)
                    progressed = True
            if self._resolve_pending() or progressed:
                continue
            stuck = [f"stage {r}: {op}" for r, op in enumerate(self.pending) if op]
            if stuck:
                raise RuntimeError("vocabulary schedule deadlocks: " + "; ".join(stuck))
            return Timeline(stages=tuple(tuple(s) for s in self.out))

    # ---- dependencies -------------------------------------------------------------------------

    def _ready_at(self, r: int, op: Op) -> float | None:
        """When the inputs of compute pass `op` are available on stage r (None: not known yet)."""
        j, last = op.mb, r == self.p - 1
        if not self.vocab or op.kind == "IF":
            return 0.0
        if op.kind == "F":
            return self._coll("emb_fwd", j) if r == 0 else 0.0
        if op.kind == "B":
            if not last:
                return 0.0
            if self.barriers == 2:
                return self._coll("input_grad", j)
            return _latest(self.done.get((r, "L", j)), self._job_end("stats", j))
        if op.kind == "S":
            return 0.0 if last else self._coll("hidden", j)
        if op.kind == "L":
            return self._coll("stats", j)
        if op.kind == "T":
            grad = self.done.get((r, "L", j)) if last else self._coll("token_grad", j)
            return _latest(grad, self._coll("stats", j))
        assert op.kind == "IB", op
        return 0.0 if r == 0 else self._coll("emb_bwd", j)

    def _coll(self, kind: str, j: int) -> float | None:
        """When collective (kind, j) delivers on every rank: all posted, FIFO predecessor done."""
        if (kind, j) in self.coll_end:
            return self.coll_end[(kind, j)]
        posts = self.posts.get((kind, j), {})
        prev = 0.0 if j == 0 else self._job_end(kind, j - 1)
        # A broadcast needs its root's send and every stage's receive (posted receive_window
        # micro-batches ahead); a reduction needs every stage.
        needed = self.p + 1 if kind in _BROADCASTS else self.p
        if len(posts) < needed or prev is None:
            return None
        latency = {"hidden": self.c.broadcast_s, "emb_bwd": self.c.broadcast_s,
                   "stats": self.c.all_gather_s, "token_grad": self.c.all_gather_s,
                   "input_grad": self.c.all_reduce_s, "emb_fwd": self.c.all_reduce_s}[kind]
        self.coll_end[(kind, j)] = end = max(max(posts.values()), prev) + latency
        return end

    def _job_end(self, kind: str, j: int) -> float | None:
        """End of the worker job: the 1-barrier stats job also all-reduces the input gradient."""
        end = self._coll(kind, j)
        if end is not None and kind == "stats" and self.barriers == 1 and not self.fwd_only:
            end += self.c.all_reduce_s
        return end

    def _post(self, key: tuple, who: int | str, time_s: float) -> None:
        self.posts.setdefault(key, {})[who] = time_s  # type: ignore[index]

    # ---- committing and finishing passes ------------------------------------------------------

    def _commit(self, r: int, op: Op) -> None:
        if op.kind in _P2P:
            for key, side in _messages(r, op):
                self._post(key, side, self.t[r])
        self.pending[r] = op

    def _resolve_pending(self) -> bool:
        """Finish every pending pass whose inputs became known; True if any did."""
        any_progress, progress = False, True
        while progress:
            progress = False
            for r in range(self.p):
                if self.pending[r] is not None and self._try_finish(r):
                    progress = any_progress = True
        return any_progress

    def _try_finish(self, r: int) -> bool:
        op = self.pending[r]
        assert op is not None
        if op.kind in _P2P:
            ends = [self._message_end(key) for key, _ in _messages(r, op)]
            known = [e for e in ends if e is not None]
            if len(known) < len(ends):
                return False
            self._finish(r, op, self.t[r], max([self.t[r], *known]))
            return True
        ready = self._ready_at(r, op)
        if ready is None:
            return False
        start = max(self.t[r], ready)
        self._finish(r, op, start, start + self._duration(r, op))
        return True

    def _message_end(self, key: tuple) -> float | None:
        sides = self.posts.get(key, {})
        return max(sides.values()) + self.c.p2p_s if len(sides) == 2 else None

    def _duration(self, r: int, op: Op) -> float:
        c = self.c
        return {"F": c.forward_s[r], "B": c.backward_s[r], "S": c.output_forward_s,
                "T": c.output_backward_s, "L": c.loss_s, "IF": c.input_forward_s,
                "IB": c.input_backward_s}[op.kind]

    def _finish(self, r: int, op: Op, start: float, end: float) -> None:
        self.pending[r] = None
        self.out[r].append(TimedOp(op=op, start_s=start, end_s=end))
        self.t[r] = end
        self.done[(r, op.kind, op.mb)] = end
        j, last, first = op.mb, r == self.p - 1, r == 0
        posts = {
            "IF": [("emb_fwd", j)], "S": [("stats", j)], "L": [("token_grad", j)],
            "T": [("input_grad", j)] if self.barriers == 2 else [],
            "F": [("hidden", j)] if last else [], "B": [("emb_bwd", j)] if first else [],
        }.get(op.kind, [])
        for key in posts if self.vocab else ():
            self._post(key, r, end)
        if self.vocab and op.kind in _RECEIVES:  # consuming receive j posts receive j + window
            self._post((_RECEIVES[op.kind], j + self.window), f"recv{r}", end)


_P2P = frozenset({"RF", "SF", "SFRB", "SBRF", "RB", "SB"})
_BROADCASTS = frozenset({"hidden", "token_grad", "emb_bwd"})
_RECEIVES = {"S": "hidden", "T": "token_grad", "IB": "emb_bwd"}
"""The pass that consumes a broadcast receive of its micro-batch (passes.py)."""


@functools.lru_cache(maxsize=1 << 16)
def _messages(r: int, op: Op) -> list[tuple[tuple, str]]:
    """(message key, side) pairs of a P2P call; a message is (kind, mb, sender stage)."""
    out = []
    if (sent := op.sent()) is not None:
        out.append((("msg", sent[0], sent[1], r), "send"))
    if (recv := op.received()) is not None:
        src = r - 1 if recv[0] == "act" else r + 1
        out.append((("msg", recv[0], recv[1], src), "recv"))
    return out


def _latest(*times: float | None) -> float | None:
    return None if any(t is None for t in times) else max(times)  # type: ignore[type-var]
