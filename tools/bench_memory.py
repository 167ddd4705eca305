"""The cost model's memory terms against the bytes this package's runtime holds, term by term.

    python tools/bench_memory.py [--json bench_memory.json]

Runs tiny Llama-style models (fp32, CPU, 2 gloo ranks) through `build_model` /
`backend_for_model` / `train_step` and measures, on each rank:

  activations  bytes of the distinct storages autograd saves for backward during one
               micro-batch's forward (a `torch.autograd.graph.saved_tensors_hooks` pack hook;
               parameters and their gradient buffers excluded), per transformer layer: the
               difference between the same plan with 4 and with 2 layers, over 2 (embedding,
               output layer and loss cancel). Against planner/cost/memory.py
               layer_activation_bytes (no flash attention on CPU; dropout as configured) plus
               unfused_activation_bytes (what the unfused local layers keep beyond that
               fused-kernel formula); the JSON keeps the formula alone as `fused_formula_bytes`.
  MoE layers   megatron-core's MoE layer (4 experts, top-2, SequentialMLP, alltoall dispatcher)
               under expert and expert-tensor parallelism: the bytes saved while each layer's
               forward runs, against planner/cost/moe.py moe_activation_bytes +
               moe_unfused_bytes at the rows that layer's local experts received (R, read from
               the experts' input), so routing imbalance is measured, not assumed.
  in flight    pipeline (pp 2, 4 micro-batches): the peak of the saved bytes alive at once on
               each stage (a finalizer per saved storage) over one micro-batch's saved bytes,
               against Megatron's 1F1B count min(pp - stage, m) the cost model uses; and with
               2 model chunks per rank (interleaved, 1 layer each) the peak bytes against
               pipeline.interleaved_inflight's chunk counts x each chunk's measured bytes
               (what cost/evaluate.stage_sums sums).
  states       weights, gradients and optimizer states per ZeRO level (0-3, dp 2) on the live
               tensors (megatron_adapter/state_memory.py), against memory.py
               state_bytes_breakdown x the layer's parameters per GPU.

Prints one row per term and grid point (measured, predicted, ratio) and writes --json.
A benchmark, not a test: no assertion on the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_ext.plan import LayerStrategy as L
from megatron_ext.plan import ParallelPlan, VocabStrategy
from megatron_ext.runtime.testing import run_distributed
from megatron_ext.specs import MLASpec, ModelSpec, MoESpec

MODEL = ModelSpec(
    name="bench-mem", num_layers=4, hidden_size=128, ffn_hidden_size=352,
    num_attention_heads=4, num_query_groups=2, vocab_size=512, max_position_embeddings=256,
)
MHA_MODEL = dataclasses.replace(MODEL, name="bench-mem-mha", hidden_size=192,
                                ffn_hidden_size=512, num_attention_heads=6, num_query_groups=6)
"""A second shape to check the terms on (no grouped-query attention, other widths)."""
MLA_MODEL = dataclasses.replace(
    MODEL, name="bench-mem-mla", num_query_groups=4, qk_layernorm=True,
    mla=MLASpec(q_lora_rank=48, kv_lora_rank=32, qk_head_dim=32, qk_pos_emb_head_dim=16,
                v_head_dim=32, rope_type="rope"))
"""Multi-latent attention (megatron-core's MLASelfAttention) on MODEL's width."""
MLA_NOQ_MODEL = dataclasses.replace(
    MLA_MODEL, name="bench-mem-mla-noq",
    mla=dataclasses.replace(MLA_MODEL.mla, q_lora_rank=None, kv_lora_rank=24, v_head_dim=16))
"""MLA without the query's compression (DeepSeek-V2-Lite's form), other latent and value widths."""
MOE_MODEL = dataclasses.replace(MODEL, name="bench-mem-moe", moe=MoESpec(
    num_experts=4, router_topk=2, ffn_hidden_size=96))
MOE_GELU_MODEL = dataclasses.replace(MOE_MODEL, name="bench-mem-moe-gelu", activation="gelu")
SEQ, MBS = 64, 4
WORLD = 2
ACTIVATION_GRID = [  # (label, strategy, dropout); labels starting "mha " use MHA_MODEL
    ("tp1 dp2", L(tp=1, dp=2), False),
    ("tp1 dp2 dropout", L(tp=1, dp=2), True),
    ("tp2", L(tp=2), False),
    ("tp2 sp", L(tp=2, sp=True), False),
    ("tp2 sp dropout", L(tp=2, sp=True), True),
    ("tp1 dp2 rc:sel", L(tp=1, dp=2, recompute="selective"), False),
    ("tp2 sp rc:sel", L(tp=2, sp=True, recompute="selective"), False),
    ("tp1 dp2 rc:full", L(tp=1, dp=2, recompute="full"), False),
    ("tp2 sp rc:full", L(tp=2, sp=True, recompute="full"), False),
    ("mha tp2 sp dropout", L(tp=2, sp=True), True),
    ("mha tp1 dp2 rc:sel", L(tp=1, dp=2, recompute="selective"), True),
    ("cp2", L(tp=1, cp=2), False),
    ("cp2 rc:sel", L(tp=1, cp=2, recompute="selective"), False),
    ("ulysses2", L(tp=1, ulysses=2), False),
    ("ulysses2 rc:sel", L(tp=1, ulysses=2, recompute="selective"), False),
    ("mla tp1 dp2", L(tp=1, dp=2), False),
    ("mla tp2 sp", L(tp=2, sp=True), False),
    ("mla tp1 dp2 rc:sel", L(tp=1, dp=2, recompute="selective"), False),
    ("mla-noq tp1 dp2", L(tp=1, dp=2), False),
    ("mla tp1 dp2 rc:full", L(tp=1, dp=2, recompute="full"), False),
]

MOE_GRID = [  # (label, strategy); labels starting "moe-gelu " use MOE_GELU_MODEL
    ("moe ep1 dp2", L(tp=1, dp=2)),
    ("moe ep2 dp2", L(tp=1, dp=2, ep=2)),
    ("moe ep2 dp2 rc:sel", L(tp=1, dp=2, ep=2, recompute="selective")),
    ("moe tp2 sp etp2", L(tp=2, sp=True, etp=2)),
    ("moe-gelu ep2 dp2", L(tp=1, dp=2, ep=2)),
]
VOCAB_GRID = [  # (label, strategy of the layers and of the vocabulary's tp, dropout)
    ("vocab tp1 dp2", L(tp=1, dp=2), False),
    ("vocab tp1 dp2 dropout", L(tp=1, dp=2), True),
    ("vocab tp2 sp", L(tp=2, sp=True), False),
    ("vocab tp2 sp dropout", L(tp=2, sp=True), True),
]


def grid_model(label: str) -> ModelSpec:
    if label.startswith("mla-noq "):
        return MLA_NOQ_MODEL
    if label.startswith("mla "):
        return MLA_MODEL
    return MHA_MODEL if label.startswith("mha ") else MODEL


def plan_of(strategy: L, *, layers: int, pp: int = 1, num_mb: int = 1,
            base: ModelSpec = MODEL, virtual_stages: int = 1) -> ParallelPlan:
    model = dataclasses.replace(base, num_layers=layers)
    chunks = pp * virtual_stages
    stages = tuple((i * layers // chunks, (i + 1) * layers // chunks) for i in range(chunks))
    return ParallelPlan(world_size=WORLD, pp=pp, stages=stages, layers=(strategy,) * layers,
                        model=model, micro_batch_size=MBS, global_batch_size=MBS * num_mb,
                        seq_length=SEQ, precision="fp32", virtual_stages=virtual_stages,
                        vocab=VocabStrategy(mode="tp", tp=strategy.tp))


def batches(plan: ParallelPlan) -> list[dict]:
    import torch

    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(plan.num_microbatches):
        ids = torch.randint(0, plan.model.vocab_size, (plan.micro_batch_size,
                                                       plan.seq_length + 1), generator=gen)
        out.append({"tokens": ids[:, :-1], "labels": ids[:, 1:],
                    "loss_mask": torch.ones(plan.micro_batch_size, plan.seq_length)})
    return out


def opt_config():
    import torch
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, clip_grad=1.0,
                           params_dtype=torch.float32)


class SavedBytes:
    """Pack hook: distinct storages autograd saves, per micro-batch, parameters excluded; with
    `track`, a finalizer per storage so the live micro-batches can be counted."""

    def __init__(self, excluded: set[int], track: bool = False) -> None:
        self.excluded, self.track = excluded, track
        self.seen: set[int] = set()
        self.bytes = 0
        self.first_bytes = 0  # the first micro-batch's saved bytes
        self.tensors: list[tuple[tuple[int, ...], str, int]] = []  # (shape, dtype, bytes)
        self.live_bytes = 0
        self.peak_live_bytes = 0
        self.micro = -1
        self.call_bytes: list[int] = []  # saved bytes of each forward call but the last

    def start(self) -> None:
        import gc

        gc.collect()  # autograd graphs freed by their backward release their saved storages
        if self.micro == 0:
            self.first_bytes = self.bytes
        if self.micro >= 0:
            self.call_bytes.append(self.bytes)
        self.micro += 1
        self.seen, self.bytes, self.tensors = set(), 0, []

    def pack(self, tensor):
        import weakref

        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.excluded or key in self.seen or storage.nbytes() == 0:
            return tensor
        self.seen.add(key)
        self.bytes += storage.nbytes()
        self.tensors.append((tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""),
                             storage.nbytes()))
        if self.track:
            self.live_bytes += storage.nbytes()
            self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
            weakref.finalize(storage, self._freed, storage.nbytes())
        return tensor

    def _freed(self, nbytes: int) -> None:
        self.live_bytes -= nbytes


def _run_plan(plan: ParallelPlan, *, dropout: bool, track: bool = False,
              instrument=None) -> SavedBytes:
    import torch
    from torch.autograd.graph import saved_tensors_hooks

    from megatron_ext.megatron_adapter.build import build_model
    from megatron_ext.megatron_adapter.losses import (
        forward_step,
        layerwise_forward_step,
        vocab_view,
    )
    from megatron_ext.megatron_adapter.optimizer import build_optimizer
    from megatron_ext.megatron_adapter.training.loop import train_step
    from megatron_ext.megatron_adapter.training.select import backend_for_model
    from megatron_ext.megatron_adapter.transformer_config import (
        ModelOptions,
        transformer_config,
    )

    rate = 0.1 if dropout else 0.0
    config = transformer_config(plan.model, precision="fp32", options=ModelOptions(
        hidden_dropout=rate, attention_dropout=rate))
    chunks, groups = build_model(plan, config)
    optimizer = build_optimizer(chunks, opt_config())
    excluded = {t.untyped_storage().data_ptr() for c in chunks for p in c.parameters()
                for t in (p, getattr(p, "main_grad", None)) if t is not None}
    counter = SavedBytes(excluded, track=track)
    if instrument is not None:
        instrument(chunks, counter)

    step = (layerwise_forward_step if plan.vocab.mode == "tp"
            else functools.partial(forward_step, vocab_view, False))

    def probe(data_iterator, model):
        counter.start()
        with saved_tensors_hooks(counter.pack, lambda t: t):
            return step(data_iterator, model)

    backend = backend_for_model(chunks, groups, optimizer, forward_step_func=probe)
    torch.manual_seed(0)
    train_step(backend, iter([backend.shard.rows(b) for b in batches(plan)]))
    return counter


def activation_rank(rank: int, world_size: int, labels: list[str] | None = None) -> dict:
    warnings.filterwarnings("ignore")
    out: dict = {"tensors": {}}
    for label, strategy, dropout in ACTIVATION_GRID:
        if labels is not None and label not in labels:
            continue
        runs = [_run_plan(plan_of(strategy, layers=n, base=grid_model(label)), dropout=dropout)
                for n in (2, 4)]
        out[label] = (runs[1].bytes - runs[0].bytes) / 2
        extra = list(runs[1].tensors)  # what two more layers save: 4-layer list minus 2-layer
        for t in runs[0].tensors:
            if t in extra:
                extra.remove(t)
        out["tensors"][label] = sorted(extra, key=lambda t: -t[2])
    return out


def _hook_layers(chunks, counter: SavedBytes, layers: list[dict], etp: int | None = None) -> None:
    """Append one dict per TransformerLayer forward to `layers`: its saved bytes (the counter's
    growth between the layer's forward pre- and post-hook) and, with `etp`, the rows its local
    experts received (the experts' input rows over etp: under expert-tensor parallelism the
    experts run on the all-gathered rows of the etp group)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    def pre(module, args):
        layers.append({"start": counter.bytes, "recv": 0.0})

    def post(module, args, output):
        layers[-1]["bytes"] = counter.bytes - layers[-1].pop("start")

    def experts_in(module, args):
        layers[-1]["recv"] += args[0].shape[0] / etp

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TransformerLayer):
                module.register_forward_pre_hook(pre)
                module.register_forward_hook(post)
                if etp is not None:
                    module.mlp.experts.register_forward_pre_hook(experts_in)


def moe_rank(rank: int, world_size: int) -> dict:
    """Per MoE grid case (3 layers, 1 micro-batch): each layer's saved bytes and routed rows."""
    warnings.filterwarnings("ignore")
    out: dict = {}
    for label, strategy in MOE_GRID:
        model = MOE_GELU_MODEL if label.startswith("moe-gelu ") else MOE_MODEL
        layers: list[dict] = []
        _run_plan(plan_of(strategy, layers=3, base=model), dropout=False,
                  instrument=lambda chunks, counter, etp=strategy.expert_tp, layers=layers:
                  _hook_layers(chunks, counter, layers, etp))
        out[label] = layers
    return out


def vocab_rank(rank: int, world_size: int) -> dict:
    """Per vocabulary grid case (pp 1, 2 layers, 1 micro-batch): the bytes saved outside the
    transformer layers (embedding, final norm, output layer, loss)."""
    warnings.filterwarnings("ignore")
    out: dict = {}
    for label, strategy, dropout in VOCAB_GRID:
        layers: list[dict] = []
        counter = _run_plan(plan_of(strategy, layers=2), dropout=dropout,
                            instrument=lambda chunks, counter, layers=layers:
                            _hook_layers(chunks, counter, layers))
        out[label] = counter.bytes - sum(layer["bytes"] for layer in layers)
    return out


_RUNNER_SKIPS = frozenset({"w_in", "w_out", "_emb_grad", "groups", "partition", "_background",
                           "_in_order"})
"""VocabPassRunner attributes that are not activation state: the weight shards, the embedding's
gradient accumulator (a gradient, flushed into the weight at the end of the iteration) and the
communication helpers."""


def _held_storages(obj, out: dict[int, int], seen: set[int]) -> None:
    """Storages (data_ptr -> bytes) of the tensors `obj` references: through dicts, lists,
    tuples, dataclasses and objects, and through a tensor's grad_fn to what its backward saved
    (the logits GEMM keeps X alive that way), weights aside."""
    import torch

    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        out[storage.data_ptr()] = storage.nbytes()
        fn = obj.grad_fn
        for name in dir(fn) if fn is not None else ():
            saved = getattr(fn, name, None) if name.startswith("_saved_") else None
            if isinstance(saved, torch.Tensor) and not saved.requires_grad:
                _held_storages(saved, out, seen)
        return
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    else:
        names = list(getattr(obj, "__dict__", {})) + list(getattr(type(obj), "__slots__", ()))
        items = [getattr(obj, n, None) for n in names if n not in _RUNNER_SKIPS]
    for item in items:
        _held_storages(item, out, seen)


def vocab_parallel_rank(rank: int, world_size: int, algorithm: int) -> dict:
    """pp 2 (1 layer a stage), 4 micro-batches, vocabulary-parallel with `algorithm` barriers:
    the peak bytes the vocabulary passes hold (VocabPassRunner's state after each of its
    passes), the most S states alive at once, and the layer activations' peak over one
    micro-batch's (in flight)."""
    warnings.filterwarnings("ignore")
    from megatron_ext.runtime.vocab.passes import VocabPassRunner

    seen = {"peak": 0, "live_states": 0, "peak_states": 0}
    originals = {}

    def wrap(name: str, delta: int):
        original = getattr(VocabPassRunner, name)
        originals[name] = original

        def run(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            seen["live_states"] += delta
            seen["peak_states"] = max(seen["peak_states"], seen["live_states"])
            held: dict[int, int] = {}
            _held_storages(self, held, set())
            seen["peak"] = max(seen["peak"], sum(held.values()))
            return result
        setattr(VocabPassRunner, name, run)

    for name in ("input_forward", "take_embedding", "input_backward", "publish_hidden",
                 "token_losses", "publish_token_grads", "hidden_grad"):
        wrap(name, 0)
    wrap("output_forward", 1)
    wrap("output_backward", -1)
    try:
        plan = dataclasses.replace(plan_of(L(tp=1), layers=2, pp=2, num_mb=4), vocab=VocabStrategy(
            mode="vocab_parallel", tp=1, algorithm=algorithm))
        counter = _run_plan(plan, dropout=False, track=True)
    finally:
        for name, original in originals.items():
            setattr(VocabPassRunner, name, original)
    return {"stage": rank, "algorithm": algorithm, "peak_held_bytes": seen["peak"],
            "peak_output_states": seen["peak_states"], "num_microbatches": 4,
            "peak_live_bytes": counter.peak_live_bytes, "microbatch_bytes": counter.first_bytes}


def inflight_rank(rank: int, world_size: int) -> dict:
    warnings.filterwarnings("ignore")
    plan = plan_of(L(tp=1), layers=4, pp=2, num_mb=4)
    counter = _run_plan(plan, dropout=False, track=True)
    return {"stage": rank, "peak_live_bytes": counter.peak_live_bytes,
            "microbatch_bytes": counter.first_bytes,
            "num_microbatches": plan.num_microbatches}


def interleaved_rank(rank: int, world_size: int) -> dict:
    """pp 2 with 2 model chunks per rank (1 layer each), 4 micro-batches: the peak of the saved
    bytes alive on the stage, and each chunk's saved bytes per micro-batch (forward call i runs
    chunk (i // pp) % v in megatron-core's interleaved schedule)."""
    warnings.filterwarnings("ignore")
    plan = plan_of(L(tp=1), layers=4, pp=2, num_mb=4, virtual_stages=2)
    counter = _run_plan(plan, dropout=False, track=True)
    calls = counter.call_bytes
    chunk_bytes = [calls[c * plan.pp] for c in range(plan.virtual_stages)]
    return {"stage": rank, "peak_live_bytes": counter.peak_live_bytes,
            "chunk_bytes": chunk_bytes, "num_microbatches": plan.num_microbatches,
            "virtual_stages": plan.virtual_stages}


def states_rank(rank: int, world_size: int) -> dict:
    warnings.filterwarnings("ignore")
    import torch

    from megatron_ext.megatron_adapter.build import build_model
    from megatron_ext.megatron_adapter.losses import layerwise_forward_step
    from megatron_ext.megatron_adapter.optimizer import build_optimizer
    from megatron_ext.megatron_adapter.state_memory import class_state_bytes
    from megatron_ext.megatron_adapter.training.loop import train_step
    from megatron_ext.megatron_adapter.training.select import backend_for_model

    plan = dataclasses.replace(plan_of(L(tp=1, dp=2), layers=4, num_mb=2), layers=tuple(
        L(tp=1, dp=2, zero=z) for z in (0, 1, 2, 3)), vocab=VocabStrategy(mode="tp", tp=2))
    chunks, groups = build_model(plan)
    optimizer = build_optimizer(chunks, opt_config())
    seen: list = []
    out: dict = {}

    def probe(data_iterator, model):
        result = layerwise_forward_step(data_iterator, model)
        seen.append(None)
        if len(seen) == 2 * plan.num_microbatches:  # last micro-batch of step 2
            out["classes"] = class_state_bytes(chunks[0], optimizer)
        return result

    backend = backend_for_model(chunks, groups, optimizer, forward_step_func=probe)
    for _ in range(2):
        torch.manual_seed(0)
        train_step(backend, iter([backend.shard.rows(b) for b in batches(plan)]))
    return out


def report(act: list[dict], inflight: list[dict], states: list[dict],
           interleaved: list[dict] | None = None, moe: list[dict] | None = None,
           vocab: list[dict] | None = None, vocab_parallel: list[dict] | None = None
           ) -> dict:
    import numpy as np

    from megatron_ext.planner.cost.compute import layer_params
    from megatron_ext.planner.cost.memory import (
        layer_activation_bytes,
        state_bytes_breakdown,
        unfused_activation_bytes,
    )
    from megatron_ext.planner.cost.pipeline import interleaved_inflight, num_warmup

    rows = []
    codes = {"none": 0, "selective": 1, "full": 2}
    for label, s, dropout in ACTIVATION_GRID:
        if label not in act[0]:
            continue
        measured = max(r[label] for r in act)
        shape = dict(b=MBS / s.dp, seq_length=SEQ, tp=np.array([s.tp]), sp=np.array([s.sp]),
                     cp=np.array([s.cp]), ulysses=np.array([s.ulysses]),
                     recompute=np.array([codes[s.recompute]]), element_bytes=4, dropout=dropout)
        model = grid_model(label)
        fused = float(layer_activation_bytes(model, flash_attention=False, **shape)[0])
        unfused = float(unfused_activation_bytes(model, **shape)[0])
        rows.append({"term": "activations per layer and micro-batch", "case": label,
                     "measured_bytes": measured, "predicted_bytes": fused + unfused,
                     "fused_formula_bytes": fused, "unfused_term_bytes": unfused})
    rows.extend(moe_rows(moe or []))
    rows.extend(vocab_rows(vocab or []))
    rows.extend(vocab_parallel_rows(vocab_parallel or []))
    for r in inflight:
        predicted = num_warmup(r["stage"], 2, r["num_microbatches"]) + 1
        rows.append({"term": "micro-batches in flight (1F1B)", "case": f"pp2 stage {r['stage']}",
                     "measured_bytes": r["peak_live_bytes"] / r["microbatch_bytes"],
                     "predicted_bytes": min(predicted, r["num_microbatches"])})
    for r in interleaved or []:
        counts = interleaved_inflight(2, r["num_microbatches"], r["virtual_stages"])
        predicted = float((counts[:, r["stage"], :] * np.array(r["chunk_bytes"])).sum(-1).max())
        rows.append({"term": "in flight, interleaved (bytes)",
                     "case": f"pp2 v{r['virtual_stages']} stage {r['stage']}",
                     "measured_bytes": r["peak_live_bytes"], "predicted_bytes": predicted,
                     "chunk_bytes": r["chunk_bytes"]})
    per_gpu = layer_params(MODEL)
    names = ("weights", "gradients", "optimizer states")
    for cls in states[0]["classes"]:
        if not all(m.endswith("TransformerLayer") for m in cls["modules"]):
            continue
        layers = sum(1 for m in cls["modules"] if m.endswith("TransformerLayer"))
        parts = state_bytes_breakdown(cls["zero"], 2, half_precision=False)
        for i, (name, key) in enumerate(zip(names, ("param_bytes", "grad_bytes",
                                                    "optimizer_bytes"))):
            measured = max(s["classes"][states[0]["classes"].index(cls)][key] for s in states)
            rows.append({"term": name, "case": f"zero {cls['zero']} dp2",
                         "measured_bytes": measured,
                         "predicted_bytes": float(parts[i]) * per_gpu * layers})
    for r in rows:
        p = r["predicted_bytes"]
        r["ratio"] = r["measured_bytes"] / p if p else float("nan")
    terms = [r for r in rows if not r.get("bound")]
    bounds = [r for r in rows if r.get("bound")]
    within = [abs(r["ratio"] - 1) <= 0.05 for r in terms]
    return {"rows": rows, "within_5pct": sum(within), "total": len(terms),
            "bounds_held": sum(r["measured_bytes"] <= r["predicted_bytes"] for r in bounds),
            "bounds": len(bounds),
            "saved_tensors_per_two_layers": act[0]["tensors"],
            "setup": {"model": MODEL.to_dict(), "mha_model": MHA_MODEL.to_dict(),
                      "mla_model": MLA_MODEL.to_dict(), "moe_model": MOE_MODEL.to_dict(),
                      "seq_length": SEQ, "micro_batch_size": MBS, "world_size": WORLD,
                      "precision": "fp32"}}


def moe_rows(moe: list[dict]) -> list[dict]:
    """One row per MoE grid case: of layers 1 and 2 on either rank (layer 0 also saves the causal
    mask every layer shares), the one whose experts received the most rows, against the cost
    model at those rows."""
    import numpy as np

    from megatron_ext.planner.cost.memory import RECOMPUTE_CODES
    from megatron_ext.planner.cost.moe import moe_activation_bytes, moe_unfused_bytes
    from megatron_ext.planner.space import StrategyTable

    rows = []
    for label, s in MOE_GRID:
        if not moe or label not in moe[0]:
            continue
        model = MOE_GELU_MODEL if label.startswith("moe-gelu ") else MOE_MODEL
        table = StrategyTable.of([s])
        measured = max((layer for r in moe for layer in r[label][1:]),
                       key=lambda x: (x["recv"], x["bytes"]))
        shape = dict(b=MBS / s.dp, seq_length=SEQ, recv=measured["recv"], element_bytes=4,
                     recompute=np.array([RECOMPUTE_CODES[s.recompute]]), dropout=False)
        fused = float(moe_activation_bytes(model, table, flash_attention=False, **shape)[0])
        unfused = float(moe_unfused_bytes(model, table, **shape)[0])
        rows.append({"term": "MoE layer activations (routed rows R)", "case": label,
                     "measured_bytes": measured["bytes"], "predicted_bytes": fused + unfused,
                     "fused_formula_bytes": fused, "unfused_term_bytes": unfused,
                     "routed_rows": measured["recv"]})
    return rows


def vocab_rows(vocab: list[dict]) -> list[dict]:
    """One row per vocabulary grid case (the larger rank), against planner/cost/vocab.py
    vocab_activation_bytes plus what the unfused local final norm and dropout keep beyond it
    (as in memory.unfused_activation_bytes: the norm's normalised output and fp32 inverse RMS,
    the dropout mask as fp32 noise)."""
    import numpy as np

    from megatron_ext.planner.cost.vocab import vocab_activation_bytes

    rows = []
    for label, s, dropout in VOCAB_GRID:
        if not vocab or label not in vocab[0]:
            continue
        plan = plan_of(s, layers=2)
        tokens = MBS * SEQ / (WORLD // plan.vocab.tp)
        e, h, tv = 4, MODEL.hidden_size, plan.vocab.tp
        fused = float(vocab_activation_bytes(MODEL, plan.vocab, 1, tokens, np.ones(1, dtype=int),
                                             element_bytes=e, dropout=dropout,
                                             num_microbatches=1)[0])
        unfused = tokens / tv * (e * h + 4) + ((e - 1) * tokens * h / tv if dropout else 0.0)
        rows.append({"term": "vocabulary layers (tp mode)", "case": label,
                     "measured_bytes": max(r[label] for r in vocab),
                     "predicted_bytes": fused + unfused, "fused_formula_bytes": fused,
                     "unfused_term_bytes": unfused})
    return rows


def vocab_parallel_rows(runs: list[dict]) -> list[dict]:
    """Per stage and barrier count: the passes' held bytes against vocab_parallel_state_bytes
    at the measured S-state count, that count against the cost model's bound, and the layers'
    micro-batches in flight against inflight_microbatches."""
    import numpy as np

    from megatron_ext.planner.cost.vocab import (
        inflight_microbatches,
        output_state_bound,
        vocab_parallel_state_bytes,
    )

    rows = []
    for r in runs:
        pp, m, k = 2, r["num_microbatches"], r["stage"]
        vocab = VocabStrategy(mode="vocab_parallel", tp=1, algorithm=r["algorithm"])
        states = np.zeros(pp)
        states[k] = r["peak_output_states"]
        held = vocab_parallel_state_bytes(MODEL, vocab, pp, MBS * SEQ, m, element_bytes=4,
                                          output_states=states)[k]
        case = f"pp2 b{r['algorithm']} stage {k}"
        rows.append({"term": "vocabulary-parallel passes (bytes)", "case": case,
                     "measured_bytes": r["peak_held_bytes"], "predicted_bytes": float(held),
                     "output_states": r["peak_output_states"]})
        rows.append({"term": "vocab-parallel S states (bound)", "case": case,
                     "measured_bytes": r["peak_output_states"],
                     "predicted_bytes": float(output_state_bound(pp, m)[k]), "bound": True})
        rows.append({"term": "micro-batches in flight (vocab-parallel)", "case": case,
                     "measured_bytes": r["peak_live_bytes"] / r["microbatch_bytes"],
                     "predicted_bytes": float(inflight_microbatches(pp, m, vocab)[k])})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    act = run_distributed(activation_rank, world_size=WORLD, timeout_s=1800)
    inflight = run_distributed(inflight_rank, world_size=WORLD, timeout_s=600)
    states = run_distributed(states_rank, world_size=WORLD, timeout_s=600)
    interleaved = run_distributed(interleaved_rank, world_size=WORLD, timeout_s=600)
    moe = run_distributed(moe_rank, world_size=WORLD, timeout_s=600)
    vocab = run_distributed(vocab_rank, world_size=WORLD, timeout_s=600)
    vocab_parallel = [r for algorithm in (1, 2) for r in run_distributed(
        vocab_parallel_rank, world_size=WORLD, timeout_s=600, algorithm=algorithm)]
    out = report(act, inflight, states, interleaved, moe, vocab, vocab_parallel)
    print(f"{'term':40s} {'case':22s} {'measured':>12s} {'predicted':>12s} {'ratio':>6s}")
    for r in out["rows"]:
        print(f"{r['term']:40s} {r['case']:22s} {r['measured_bytes']:12.0f} "
              f"{r['predicted_bytes']:12.0f} {r['ratio']:6.3f}")
    print(f"within 5%: {out['within_5pct']} of {out['total']}; bounds held: "
          f"{out['bounds_held']} of {out['bounds']} (measured <= the cost model's bound)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
