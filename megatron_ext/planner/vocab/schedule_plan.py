"""Places the vocabulary passes into vocabulary-parallel 1F1B (pure Python, no torch).

`plan_vocab_schedule` returns every stage's static order of transformer passes, Megatron's P2P
calls and vocabulary passes. Placement is analytic (the reference implementation profiles f and
b at run time instead, section 6.1 of the reference notes):

1. Simulate the 1F1B skeleton with each stage's per-micro-batch vocabulary work folded into its
   forward: this gives nominal times of every pass boundary, for uneven stages too.
2. Give every vocabulary pass a boundary range from its dependencies (after the calls its
   inputs need, before any wait that needs its result: S_k before the stage receives the
   gradient whose B follows L_k; IF early enough to keep stage 0 supplied; ...) and pick, inside
   it, the boundary that best fits its nominal due time and the time its result is needed
   (idle + lateness; idle before a P2P call that waits anyway is free). Candidates avoid the
   pipeline's critical chains: nothing between F and its send in warm-up, nothing between
   receiving a gradient and B, nothing between B and its send.
3. Replay the orders with the real costs (schedule_sim), which raises if they could deadlock;
   re-derive the times from that replay and repeat, keeping the fastest plan.
"""

from __future__ import annotations

import bisect
import dataclasses

from megatron_ext.planner.vocab.schedule_ops import Op, num_warmup, skeleton_1f1b
from megatron_ext.planner.vocab.schedule_sim import PassCosts, Timeline, simulate

_MODES = ("slots", "open")
"""Candidate boundaries: "slots" = one per step (before F; the last stage: before B) plus those
before a P2P call that waits anyway (nominally), "open" = every boundary off the critical
chains. Both are tried; the faster simulated plan wins."""
_P2P_CALLS = frozenset({"RF", "SF", "SFRB", "SBRF", "RB", "SB"})
_PRIORITY = {"IF": 0, "S": 1, "L": 2, "T": 3, "IB": 4}
_CLOSED = frozenset({("F", "SF"), ("B", "SB"), ("B", "SBRF"), ("SFRB", "B"), ("RB", "B")})
"""(previous, next) skeleton pairs that should have no vocabulary pass in between: the F chain
in warm-up and the B chain are the pipeline's critical paths."""


def plan_vocab_schedule(
    num_stages: int, num_microbatches: int, *, num_barriers: int, costs: PassCosts,
    forward_only: bool = False, iterations: int = 3,
) -> Timeline:
    """Per-stage pass orders (with simulated times) for vocabulary-parallel 1F1B."""
    if num_barriers not in (1, 2):
        raise ValueError(f"num_barriers={num_barriers} must be 1 or 2")
    p, m = num_stages, num_microbatches
    extra = 0 if forward_only else num_barriers
    skel = [skeleton_1f1b(r, p, m, extra_warmup=extra, forward_only=forward_only)
            for r in range(p)]
    nominal = simulate(skel, _relaxed(costs, forward_only), vocab=False)
    best: Timeline | None = None
    failures = []
    for early_t in (True, False):  # the memory-lean T placement first; the safe one if needed
        for mode in _MODES:
            current = nominal
            for _ in range(iterations):
                placer = _Placer(skel, current, costs, num_barriers, forward_only, mode, early_t)
                try:
                    timeline = simulate(placer.orders(), costs,
                                        num_barriers=num_barriers, forward_only=forward_only)
                except RuntimeError as err:  # this variant could deadlock: never used
                    failures.append(f"{mode}: {err}")
                    break
                if best is None or timeline.makespan_s < best.makespan_s:
                    best = timeline
                current = timeline
        if best is not None:
            break
    if best is None:
        raise RuntimeError(f"no deadlock-free vocabulary schedule for pp={p}, "
                           f"micro-batches={m}, barriers={num_barriers}: {failures[0]}")
    return best


def _relaxed(costs: PassCosts, forward_only: bool) -> PassCosts:
    """Costs with each stage's vocabulary work per micro-batch folded into its forward."""
    vocab_s = costs.output_forward_s + costs.input_forward_s
    if not forward_only:
        vocab_s += costs.output_backward_s + costs.input_backward_s
    last = len(costs.forward_s) - 1
    forward = tuple(f + vocab_s + (costs.loss_s if r == last else 0.0)
                    for r, f in enumerate(costs.forward_s))
    return dataclasses.replace(costs, forward_s=forward)


class _Placer:
    """Assigns vocabulary passes to skeleton boundaries (boundary i = before skeleton op i).

    Every pass gets a boundary range from its dependencies (derivations inline) and, inside it,
    the first candidate boundary (see _MODES) at or after its nominal due time. With one
    barrier (and forward-only) the ranges alone rule out cycles; with two, T's placement also
    leans on the simulation check in plan_vocab_schedule, which discards unsafe variants.
    """

    def __init__(self, skel: list[list[Op]], nominal: Timeline, costs: PassCosts,
                 barriers: int, forward_only: bool, mode: str, early_t: bool) -> None:
        self.skel, self.c, self.fwd_only, self.mode = skel, costs, forward_only, mode
        self.early_t = early_t
        self.barriers = 0 if forward_only else barriers
        self.p, self.m = len(skel), sum(op.kind == "F" for op in skel[0])
        self.ends: dict[tuple[int, str, int], float] = {}
        self.starts: dict[tuple[int, Op], float] = {}
        self.finishes: dict[tuple[int, Op], float] = {}
        for r, stage in enumerate(nominal.stages):
            for t in stage:
                self.ends[(r, t.op.kind, t.op.mb)] = t.end_s
                self.starts[(r, t.op)] = t.start_s
                self.finishes[(r, t.op)] = t.end_s
        self.stage_end = [s[-1].end_s if s else 0.0 for s in nominal.stages]

    def _time(self, r: int, i: int) -> float:
        ops = self.skel[r]
        return self.starts[(r, ops[i])] if i < len(ops) else self.stage_end[r]

    def _open(self, r: int, i: int) -> bool:
        ops = self.skel[r]
        prev = ops[i - 1].kind if i > 0 else None
        return (prev, ops[i].kind if i < len(ops) else None) not in _CLOSED

    def _slot(self, r: int, i: int) -> bool:
        """Whether boundary i is a candidate under the placement mode."""
        ops = self.skel[r]
        if self.mode == "open" or i == len(ops):
            return self._open(r, i)
        key = "B" if r == self.p - 1 and not self.fwd_only else "F"
        if ops[i].kind == key or (ops[i].kind == "RB" and ops[i - 1].kind != "F"):
            return True
        # before a P2P call that waited in the nominal timeline: the wait absorbs the pass
        waited = self.finishes.get((r, ops[i]), 0.0) - self._time(r, i)
        return ops[i].kind in _P2P_CALLS and waited > self.c.output_forward_s and self._open(r, i)

    def _choose(self, r: int, lo: int, hi: int, due_s: float, need_s: float, cost_s: float
                ) -> int:
        """The candidate boundary in [lo, hi] that best fits a pass of `cost_s` whose inputs
        are due at due_s and whose result is needed by need_s (nominal times): least idle
        (waiting for inputs; free before a P2P call that waits anyway) plus lateness past
        need_s, earliest on ties. due_s = inf: the last candidate. Falls back to open
        boundaries, then to lo (a closed boundary costs time, not safety)."""
        hi = max(hi, lo)
        for test in (self._slot, self._open):
            if due_s == float("inf"):  # as late as possible
                found = next((i for i in range(hi, lo - 1, -1) if test(r, i)), None)
            else:
                found, best = None, float("inf")
                for i in range(lo, hi + 1):
                    if not test(r, i):
                        continue
                    time_s = self._time(r, i)
                    start_s = max(time_s, due_s)
                    cost = self._idle_s(r, i, due_s) + max(0.0, start_s + cost_s - need_s)
                    if cost < best - 1e-12:
                        found, best = i, cost
                    if time_s >= due_s and start_s + cost_s >= need_s:
                        break  # later boundaries are only later
            if found is not None:
                return found
        return lo

    def _idle_s(self, r: int, i: int, due_s: float) -> float:
        """Idle a pass at boundary i causes by waiting for inputs due at due_s."""
        time_s = self._time(r, i)
        if time_s >= due_s:
            return 0.0
        ops = self.skel[r]
        absorbed = 0.0
        if i < len(ops) and ops[i].kind in _P2P_CALLS:
            absorbed = self.finishes.get((r, ops[i]), time_s) - time_s
        return max(0.0, due_s - time_s - absorbed)

    def _last_boundary_s(self, index: int) -> float:
        """Nominal time of boundary `index` of the last stage."""
        return self._time(self.p - 1, index)

    # ---- assignment ---------------------------------------------------------------------------

    def orders(self) -> list[list[Op]]:
        """Every stage's full order: skeleton with the vocabulary passes at their boundaries."""
        self.at: dict[tuple[int, str, int], int] = {}
        self.pos = [_Positions(ops, self.m) for ops in self.skel]
        self._pairs = _neighbour_pairs(self.skel)
        self._needed_cache: dict[tuple[int, int], list[int]] = {}
        for r in range(self.p):
            self._place_if(r)
        s_end, l_end = [], []
        for k in range(self.m):
            s_end.append(max(self._place_s(r, k) for r in range(self.p)))
            l_end.append(self._place_l(k, s_end[k] + self.c.all_gather_s))
        if not self.fwd_only:
            for r in range(self.p):
                for k in range(self.m):
                    self._place_t(r, k, max(s_end[k], l_end[k]) + self.c.all_gather_s)
                    self._place_ib(r, k)
        return [self._order(r) for r in range(self.p)]

    def _order(self, r: int) -> list[Op]:
        slots: dict[int, list[Op]] = {}
        for (q, kind, k), i in self.at.items():
            if q == r:
                slots.setdefault(i, []).append(Op(kind=kind, mb=k))  # type: ignore[arg-type]
        ops, out, last = self.skel[r], [], r == self.p - 1
        for i in range(len(ops) + 1):
            # micro-batch order; on the last stage S first: it only needs the F just before,
            # and every other stage waits for the X broadcast it starts
            out += sorted(slots.get(i, []), key=lambda o: (
                not (last and o.kind == "S"), o.mb, _PRIORITY[o.kind]))
            out += ops[i:i + 1]
        return out

    def _put(self, r: int, kind: str, k: int, lo: int, hi: int, due_s: float,
             need_s: float = float("inf")) -> float:
        """Place a pass; returns its nominal end (start = max(boundary time, due))."""
        lo = max(lo, self.at.get((r, kind, k - 1), 0))
        cost = self._cost(kind)
        self.at[(r, kind, k)] = i = self._choose(r, lo, hi, due_s, need_s, cost)
        return max(self._time(r, i), due_s) + cost

    def _cost(self, kind: str) -> float:
        c = self.c
        return {"IF": c.input_forward_s, "S": c.output_forward_s, "L": c.loss_s,
                "T": c.output_backward_s, "IB": c.input_backward_s}[kind]

    def _place_if(self, r: int) -> None:
        """IF j: before the stage waits for an activation that needs stage 0's F j."""
        pos = self.pos[r]
        for j in range(self.m):
            hi = pos.f(max(j - 1, 0)) if r == 0 else pos.recv_act(j - r - 1)
            self._put(r, "IF", j, 0, hi, float("inf"))

    def _place_s(self, r: int, k: int) -> float:
        """S k: after sending activation k (X k needs it), before receiving the gradient whose
        B on the last stage follows L k (B k with 1 barrier, B k-1 with 2)."""
        pos, e, m = self.pos[r], self.barriers, self.m
        due = self.ends[(self.p - 1, "F", k)] + self.c.broadcast_s
        if r == self.p - 1:  # X k is at hand right after the last stage's F k
            return self._put(r, "S", k, pos.f(k) + 1, pos.f(k) + 1, 0.0)
        hi = pos.recv_act(k + 1 + self.p) if self.fwd_only else pos.recv_grad(k - e + 1)
        del m
        # needed by the last stage's L k (B k with 1 barrier, F k+1 with 2) after the gather
        last = self.pos[-1]
        need = (last.b(k) if e == 1 else last.f(k + 1)) if not self.fwd_only else last.end
        need_s = self._last_boundary_s(need) - self.c.all_gather_s
        return self._put(r, "S", k, pos.sent_act(k), hi, due, need_s)

    def _place_l(self, k: int, due_s: float) -> float:
        """L k on the last stage. 1 barrier: right before B k, which waits for the same
        reduction anyway. 2 barriers: before F k+1, so that X k+1's broadcast trails g k's and
        every stage runs T k right before S k+1 (the reference implementation's pairing; the
        last micro-batch: right after S k). Forward only: once due, before F k+2."""
        r = self.p - 1
        pos, s_at = self.pos[r], self.at[(r, "S", k)]
        if self.fwd_only:
            return self._put(r, "L", k, s_at, pos.f(k + 2), due_s)
        if self.barriers == 1:
            where = pos.b(k)
        else:  # (before F k+1 is before B k-1 too, which S k's range assumes)
            where = pos.f(k + 1) if k + 1 < self.m else pos.b(max(k - 1, 0))
        return self._put(r, "L", k, max(where, s_at), max(where, s_at), due_s)

    def _place_t(self, r: int, k: int, due_s: float) -> None:
        pos, m, last = self.pos[r], self.m, r == self.p - 1
        if last:  # 1 barrier: off B k's chain; 2 barriers: before B k
            lo, hi = ((pos.b(k) + 1, pos.b(k + 1)) if self.barriers == 1
                      else (self.at[(r, "L", k)], pos.b(k)))
        elif self.barriers == 1 and self.early_t:  # once g k is due, not before anything
            # L k needs (_t_floor): keeps ~1 micro-batch of S state alive instead of ~p - r
            lo, hi = self._t_floor(r, k), pos.recv_grad(k + 1)
        elif self.barriers == 1:  # after receiving gradient k: the last stage has run L k
            lo, hi = pos.recv_grad(k) + 1, pos.recv_grad(k + 1)
        else:  # right before S k+1: g k was broadcast before X k+1 (see _place_l), but not
            # before this stage has posted every call that L k (its stats, and the last
            # stage's way to L k) depends on
            lo = self._t_floor(r, k)
            hi = pos.recv_grad(k)
            if k + 1 < m:
                lo = hi = max(lo, self.at[(r, "S", k + 1)])
        need_s = float("inf")  # 1 barrier: nobody waits for T
        if self.barriers == 2:  # the last stage's B k waits for the input-gradient reduction
            need_s = self._last_boundary_s(self.pos[-1].b(k)) - self.c.all_reduce_s
        self._put(r, "T", k, lo, hi, due_s, need_s)

    def _t_floor(self, r: int, k: int) -> int:
        """2 barriers: the first boundary where T k may wait on stage r for L k's token gradients:
        no stage's S k and no step of the last stage towards L k may need stage r further."""
        last = self.p - 1
        needs = [self._needed(q, self.at[(q, "S", k)])[r] for q in range(self.p)]
        needs.append(self._needed(last, self.at[(last, "L", k)])[r])
        return max(needs + [self.at[(r, "S", k)]])

    def _needed(self, r: int, boundary: int) -> list[int]:
        """Per stage, the boundary it must have passed (its partner call posted) for stage r to
        complete its calls before `boundary`. P2P pairs between neighbours are monotone, so one
        sweep outwards from r suffices."""
        key = (r, boundary)
        if key in self._needed_cache:
            return self._needed_cache[key]
        need = [0] * self.p
        need[r] = boundary
        for step in (1, -1):
            q, done = r, boundary  # calls [0, done) of q must complete
            while 0 <= q + step < self.p:
                pairs = self._pairs[(q, q + step)]
                cut = bisect.bisect_left(pairs, (done, -1))
                if cut == 0:
                    break
                partner = pairs[cut - 1][1]  # the latest partner call that must be posted
                need[q + step] = partner + 1
                q, done = q + step, partner
        self._needed_cache[key] = need
        return need

    def _place_ib(self, r: int, k: int) -> None:
        """IB k: stage 0 right after its B k; elsewhere once the stage can know stage 0 ran
        B k, i.e. after receiving activation w0 + k + 1 (else at the end)."""
        pos, m, e = self.pos[r], self.m, self.barriers
        if r == 0:
            self._put(r, "IB", k, pos.b(k) + 1, pos.b(k) + 1, 0.0)
            return
        act = num_warmup(0, self.p, m, e) + k + 1
        lo = pos.recv_act(act) + 1 if act < m else pos.end
        due = self.ends.get((0, "B", k), 0.0) + self.c.broadcast_s
        self._put(r, "IB", k, lo, pos.end, due)


def _neighbour_pairs(skel: list[list[Op]]) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(r, r2) -> ordered (index on r, index on r2) of P2P calls that rendezvous."""
    ends: dict[tuple, list[tuple[int, int]]] = {}
    for r, ops in enumerate(skel):
        for i, op in enumerate(ops):
            for kind, mb, src in _message_keys(r, op):
                ends.setdefault((kind, mb, src), []).append((r, i))
    pairs: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for (a, i), (b, j) in (tuple(v) for v in ends.values()):
        pairs.setdefault((a, b), set()).add((i, j))
        pairs.setdefault((b, a), set()).add((j, i))
    return {key: sorted(v) for key, v in pairs.items()}


def _message_keys(r: int, op: Op) -> list[tuple[str, int, int]]:
    """(kind, micro-batch, sender) of the messages a call sends or receives."""
    keys = []
    if (sent := op.sent()) is not None:
        keys.append((sent[0], sent[1], r))
    if (recv := op.received()) is not None:
        keys.append((recv[0], recv[1], r - 1 if recv[0] == "act" else r + 1))
    return keys


class _Positions:
    """Skeleton indices of one stage's passes and calls; `len(ops)` (the end) when absent."""

    def __init__(self, ops: list[Op], m: int) -> None:
        self.end = len(ops)
        self._at: dict[tuple[str, int], int] = {}
        for i, op in enumerate(ops):
            if op.kind in ("F", "B"):
                self._at[(op.kind, op.mb)] = i
            if (recv := op.received()) is not None:
                self._at[("recv_" + recv[0], recv[1])] = i
            if (sent := op.sent()) is not None:
                self._at[("sent_" + sent[0], sent[1])] = i

    def _get(self, key: str, j: int) -> int:
        return 0 if j < 0 else self._at.get((key, j), self.end)

    def f(self, j: int) -> int:
        return self._get("F", j)

    def b(self, k: int) -> int:
        return self._get("B", k)

    def recv_act(self, j: int) -> int:
        """Boundary before the call receiving activation j (0 if j < 0)."""
        return self._get("recv_act", j)

    def recv_grad(self, k: int) -> int:
        return self._get("recv_grad", k)

    def sent_act(self, j: int) -> int:
        """Boundary after the call sending activation j (0 if there is none)."""
        return self._get("sent_act", j) + 1 if ("sent_act", j) in self._at else 0

    def sent_grad(self, k: int) -> int:
        """Boundary after the call sending gradient k (0 if there is none)."""
        return self._get("sent_grad", k) + 1 if ("sent_grad", k) in self._at else 0
