"""Parity harness (imported by spawned ranks): a plan through `build_model`/`train_step` against a
single-process stock megatron-core `GPTModel` (TP=1, local spec) with the same initial weights,
the same fixed data, torch AdamW and torch grad clipping.

Both sides start from `init_plan_invariant(seed)`: the reference holds full tensors, the plan's
model its shards, so a sharding bug shows up as a loss or gradient mismatch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from megatron_ext.plan import LayerStrategy, ParallelPlan
from megatron_ext.specs import ModelSpec

LR = 3e-3
WEIGHT_DECAY = 0.01
CLIP = 1.0


def make_plan(model: ModelSpec, layers: list[LayerStrategy], *, world: int = 4, pp: int = 1,
              stages: list[tuple[int, int]] | None = None, mbs: int = 4, num_mb: int = 2,
              seq: int = 32, **kw: Any) -> ParallelPlan:
    stages = stages or [(0, len(layers))]
    return ParallelPlan(world_size=world, pp=pp, stages=tuple(stages), layers=tuple(layers),
                        model=model, micro_batch_size=mbs, global_batch_size=mbs * num_mb,
                        seq_length=seq, precision="fp32", **kw)


def make_batches(plan: ParallelPlan, steps: int, seed: int = 7) -> list[list[dict]]:
    """One fixed global batch (num_microbatches micro-batches of full `[b, s]` tensors, same on
    every rank) for each of `steps` steps: the loss falls step by step, so a wrong update shows."""
    gen = torch.Generator().manual_seed(seed)
    micro = []
    for _ in range(plan.num_microbatches):
        ids = torch.randint(0, plan.model.vocab_size, (plan.micro_batch_size,
                                                       plan.seq_length + 1), generator=gen)
        mask = (torch.rand(plan.micro_batch_size, plan.seq_length, generator=gen) > 0.1)
        micro.append({"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": mask.float()})
    return [micro] * steps


_SINGLETON: list = []


def _singleton_pgc():
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not _SINGLETON:  # collective: every rank creates every singleton group once
        _SINGLETON.append([dist.new_group([r]) for r in range(dist.get_world_size())])
    one = _SINGLETON[0][dist.get_rank()]
    return ProcessGroupCollection(tp=one, cp=one, pp=one, embd=None, pos_embd=None)


def reference_model(plan: ParallelPlan, seed: int, divisible_by: int = 128,
                    precision: str = "fp32"):
    """Single-process stock GPTModel (TP=1, local spec) with the plan-invariant initial weights;
    vocabulary padded as build_model's `make_vocab_size_divisible_by=divisible_by`; `precision`
    "fp16": fp16 parameters and megatron's fp16 settings (Float16Module's cast)."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_ext.megatron_adapter.build import prepare_megatron
    from megatron_ext.megatron_adapter.transformer_config import transformer_config
    from megatron_ext.megatron_adapter.weights import init_plan_invariant
    from megatron_ext.geometry.vocab_partition import padded_vocab_size

    prepare_megatron()
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=0, ep_rank=0, etp_rank=0,
                                                    force_reset_rng=True)
    model_spec = plan.model
    config = transformer_config(model_spec, precision=precision)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=model_spec.normalization),
        vocab_size=padded_vocab_size(model_spec.vocab_size, plan.vocab.tp, divisible_by),
        max_sequence_length=model_spec.max_position_embeddings,
        share_embeddings_and_output_weights=model_spec.tied_embeddings,
        position_embedding_type=model_spec.position_embedding, pg_collection=_singleton_pgc(),
    )
    init_plan_invariant(model, seed)
    return model.half() if precision == "fp16" else model


def reference_run(plan: ParallelPlan, batches: list[list[dict]], seed: int,
                  divisible_by: int = 128) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process run: per-step losses and full gradients of step 1 (by global name)."""
    model = reference_model(plan, seed, divisible_by)
    named = dict(model.named_parameters())
    decay = [p for n, p in named.items() if not (n.endswith(".bias") or p.dim() == 1)]
    no_decay = [p for n, p in named.items() if n.endswith(".bias") or p.dim() == 1]
    opt = torch.optim.AdamW([{"params": no_decay, "weight_decay": 0.0},
                             {"params": decay, "weight_decay": WEIGHT_DECAY}], lr=LR)
    losses, grads = [], {}
    for step, micro in enumerate(batches):
        opt.zero_grad()
        total_tokens = sum(b["loss_mask"].sum() for b in micro)
        step_loss = 0.0
        for b in micro:
            positions = torch.arange(plan.seq_length).expand_as(b["tokens"])
            logits = model(b["tokens"], positions, None)  # [b, s, v]
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["labels"].reshape(-1),
                                 reduction="none")
            loss = (ce * b["loss_mask"].reshape(-1)).sum() / total_tokens
            loss.backward()
            step_loss += loss.item()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in named.items()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(step_loss)
    return losses, grads


def opt_config(plan: ParallelPlan):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="adam", lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=CLIP,
                           bf16=False, fp16=False, params_dtype=torch.float32)


def _owned_range(chunks, optimizer, param) -> tuple[int, int] | None:
    """Flat range of a ZeRO-1 `param` whose reduced grad lives on this rank (possibly empty);
    None for params reduced in full (DDP)."""
    zero = {id(p) for chunk in chunks for ddp in chunk.ddps
            if ddp.ddp_config.use_distributed_optimizer for p in ddp.module.parameters()}
    if id(param) not in zero:
        return None
    for opt in optimizer.chained_optimizers:
        if param in getattr(opt, "model_param_gbuf_map", {}):
            rng = opt._get_model_param_range_map(param)["param"]
            return rng.start, rng.end
    return 0, 0


def compare_grads(chunks, optimizer, ref_grads: dict[str, torch.Tensor], *, rtol: float,
                  atol: float) -> int:
    """Compare every local grad shard with the reference; returns how many were compared."""
    from megatron_ext.megatron_adapter.weights import (
        _is_gated,
        local_shard,
        param_shards,
    )

    count = 0
    shards = [(name, param, tp, chunk.module) for chunk in chunks  # every model chunk
              for name, param, tp in param_shards(chunk.module)]
    for name, param, tp, model in shards:
        key = "embedding.word_embeddings.weight" if (
            name == "output_layer.weight" and name not in ref_grads) else name
        expected = local_shard(name, ref_grads[key], param, tp, _is_gated(name, model))
        if isinstance(param, DTensor):  # ZeRO-2/3: the summed grad, reassembled from shards
            got = param.grad.full_tensor()  # collective over the layer's dp_cp group
        else:
            got = param.main_grad
        owned = _owned_range(chunks, optimizer, param)
        if owned is not None:
            got, expected = got.reshape(-1)[owned[0]:owned[1]], expected.reshape(-1)[
                owned[0]:owned[1]]
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")
        count += 1
    return count


def run_plan(plan: ParallelPlan, *, steps: int = 5, seed: int = 11,
             ref: tuple[list[float], dict] | None = None, loss_rtol: float, grad_rtol: float,
             grad_atol: float, overlap: bool = False, config: Any = None) -> dict[str, Any]:
    """Train `plan` for `steps` steps; assert losses and step-1 grads match the reference.
    `overlap`: bucketed, overlapped gradient reduction and parameter all-gather; `config`: the
    TransformerConfig to build with (default: the plan's model in fp32)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    batches = make_batches(plan, steps)
    ref_losses, ref_grads = ref if ref is not None else reference_run(plan, batches, seed)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=overlap, overlap_param_gather=overlap, bucket_size=4000 if overlap
        else None)
    backend = layerwise_backend(plan, seed=seed, config=config, ddp_config=ddp_config)
    chunks, optimizer = backend.model, backend.optimizer
    losses = []
    for step, micro in enumerate(batches):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses.append(backend.forward_backward(rank_rows(backend, micro)))  # train_step's
        if step == 0:  # before optimizer.step: clipping scales the grad buffers in place
            n = compare_grads(chunks, optimizer, ref_grads, rtol=grad_rtol, atol=grad_atol)
        optimizer.step()
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(ref_losses, dtype=torch.float64), rtol=loss_rtol,
                               atol=0.0)
    return {"losses": losses, "ref": ref_losses, "grads_compared": n}


def layerwise_backend(plan: ParallelPlan, *, seed: int, config: Any = None,
                      opt: Any = None, **build_kwargs: Any) -> Any:
    """`plan` built by `build_model` with `build_optimizer`'s chained AdamW (`opt`: its config,
    default `opt_config(plan)`), as the backend training steps (select.backend_for_model)."""
    from megatron_ext.megatron_adapter.build import build_model
    from megatron_ext.megatron_adapter.optimizer import build_optimizer
    from megatron_ext.megatron_adapter.training.select import backend_for_model

    chunks, groups = build_model(plan, config, seed=seed, **build_kwargs)
    optimizer = build_optimizer(chunks, opt or opt_config(plan))
    chunks[0].module.config.grad_scale_func = optimizer.scale_loss  # as training sets it
    return backend_for_model(chunks, groups, optimizer)


def rank_rows(backend: Any, micro: list[dict[str, torch.Tensor]]) -> Any:
    """An iterator over this rank's rows of each global micro-batch, as training reads them."""
    return iter([backend.shard.rows(batch) for batch in micro])


def replace_layers(plan: ParallelPlan, **changes: Any) -> ParallelPlan:
    return dataclasses.replace(plan, **changes)


def check_body_only(plan: ParallelPlan, seed: int = 11) -> None:
    """Body-only stage (no embedding/output layer, as vocabulary parallelism builds it): hidden
    states in `input_layout` in, final-normed hidden states in `output_layout` out, equal to the
    reference decoder's."""
    from megatron_ext.megatron_adapter.build import build_model
    from megatron_ext.runtime.redistribute import local_block

    ref = reference_model(plan, seed)
    chunks, groups = build_model(plan, seed=seed, embedding=False, output_layer=False)
    model = chunks[0].module
    assert not hasattr(model, "embedding") and not hasattr(model, "output_layer")
    s, b, h = plan.seq_length, plan.micro_batch_size, plan.model.hidden_size
    x = torch.randn(s, b, h)  # [s, b, h], same on every rank
    rope = ref.rotary_pos_emb(s) if plan.model.position_embedding == "rope" else None
    expected = ref.decoder(hidden_states=x, attention_mask=None, rotary_pos_emb=rope)
    local_x = local_block(x, model.decoder.input_layout, groups.local_rank)
    got = model(decoder_input=local_x)  # [s_loc, b_loc, h] in output_layout
    want = local_block(expected.detach(), model.decoder.output_layout, groups.local_rank)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def check_sharded_state_dict(plan: ParallelPlan, seed: int = 11, *, reference: Any = None,
                             config: Any = None) -> int:
    """Every ShardedTensor of the plan's model has its global key, global shape and offset such
    that its data equals that slice of the single-process tensor; each shard has exactly one
    main replica across all ranks. Returns the number of shards checked on this rank.
    `reference(plan, seed)` builds the single-process model (default `reference_model`);
    `config` is build_model's."""
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        ShardedTensorFactory,
    )

    from megatron_ext.megatron_adapter.build import build_model

    def shards_of(sharded: dict) -> list:
        out = []
        for item in sharded.values():
            items = item.build() if isinstance(item, ShardedTensorFactory) else [item]
            out += [t for t in items if isinstance(t, ShardedTensor)]
        return out

    def index(sh: ShardedTensor) -> tuple:
        """Where `sh` sits in its global tensor (prepended axes, e.g. the expert index, are
        one-element slices)."""
        lead = sh.prepend_axis_num
        return (*(slice(o, o + 1) for o in sh.global_offset[:lead]),
                *(slice(o, o + n) for o, n in zip(sh.global_offset[lead:], sh.data.shape)))

    ref_meta = {"non_homogeneous_layers": True, "dp_cp_group": _singleton_pgc().tp}
    ref = (reference or reference_model)(plan, seed)
    full: dict = {}  # the reference's own checkpoint keys (megatron's key map), assembled
    for sh in shards_of(ref.sharded_state_dict(metadata=ref_meta)):
        tensor = full.setdefault(sh.key, torch.zeros(sh.global_shape, dtype=sh.data.dtype))
        tensor[index(sh)] = sh.data.reshape(tensor[index(sh)].shape)
    chunks, _ = build_model(plan, config, seed=seed)
    shards = [sh for chunk in chunks for sh in shards_of(chunk.sharded_state_dict())]
    mains = []
    for sh in shards:
        assert sh.global_shape == tuple(full[sh.key].shape), (sh.key, sh.global_shape)
        want = full[sh.key][index(sh)].reshape(sh.data.shape)
        torch.testing.assert_close(sh.data, want, rtol=0, atol=0,
                                   msg=lambda m, k=sh.key: f"{k}: {m}")
        if all(r == 0 for r in (sh.replica_id if isinstance(sh.replica_id, tuple)
                                else (sh.replica_id,))):
            mains.append((sh.key, tuple(sh.global_offset)))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mains)
    counts: dict = {}
    for rank_mains in gathered:
        for entry in rank_mains:
            counts[entry] = counts.get(entry, 0) + 1
    duplicated = [e for e, n in counts.items() if n != 1]
    assert not duplicated, f"shards with several main replicas: {duplicated[:3]}"
    every = {(k, off) for rank_mains in gathered for k, off in rank_mains}
    assert {k for k, _ in every} == set(full), "keys differ from the single-process model's"
    return len(shards)
