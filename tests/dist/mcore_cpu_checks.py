"""Rank-side checks for test_mcore_cpu.py: real megatron-core 0.16.1 on CPU/gloo via `cpu_compat`.

Legend: s = sequence, b = micro-batch, h = hidden, v = vocab; tp/pp/dp = parallel sizes.

Kept out of the test module so spawned ranks import only this (by name: its folder is on the
inherited sys.path). Every parallel run is compared with an unsharded tp=pp=dp=1 reference
built in the same rank, with the same seed and identical weights.
Each spawn entry returns {check name: traceback text or None} so the parent can report every
check separately: `model_parallel_checks` (tp2, tp2+sp, pp2 1F1B) and `data_parallel_checks`
(dp2 + distributed optimizer, then a dist-checkpointing round trip of that state).
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel.schedules import (
    forward_backward_pipelining_without_interleaving,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.megatron_adapter.cpu import compat as cpu_compat
from megatron_ext.megatron_adapter.sp_norm import SPLayerNorm, gpt_block_spec

SEED = 1234
NUM_LAYERS, HIDDEN, NUM_HEADS, SEQ, VOCAB, MBS = 2, 64, 4, 32, 128, 2
NUM_MICROBATCHES = 4
# fp32 throughout. TP/SP/PP/DP change only the order of fp32 reductions (row-parallel partial
# sums, SP norm-grad sums, DP averaging): ~1e-7 relative per op. The largest deviation seen over
# every loss and gradient is 3.4e-8 absolute, ~3% of this bound (~30x headroom), while a real
# sharding bug (wrong shard, missing or doubled reduction) is an O(1) relative error.
RTOL, ATOL = 1e-5, 1e-6
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")


def _init_parallel(tp: int = 1, pp: int = 1) -> None:
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        distributed_timeout_minutes=1,  # a hung collective raises instead of waiting 30 min
    )
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)  # through the module: rng patch


def _config(*, tp: int = 1, pp: int = 1, sp: bool = False) -> TransformerConfig:
    return TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=NUM_HEADS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sp,
        pipeline_dtype=torch.float32,
    )


def _gpt(config: TransformerConfig) -> GPTModel:
    """Tied-embedding GPT for this pipeline stage, local spec (SPNorm when SP is on)."""
    return GPTModel(
        config,
        transformer_layer_spec=gpt_block_spec(config, use_transformer_engine=False),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=True,
    )


def _batches(num: int, batch_size: int, seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    position_ids = torch.arange(SEQ).expand(batch_size, SEQ)  # [b, s]
    return [
        {
            "tokens": torch.randint(0, VOCAB, (batch_size, SEQ), generator=gen),  # [b, s]
            "labels": torch.randint(0, VOCAB, (batch_size, SEQ), generator=gen),  # [b, s]
            "position_ids": position_ids,
        }
        for _ in range(num)
    ]


def _lm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return per_token.mean()  # per_token: [b, s]


def _reference_name(name: str, model: GPTModel) -> str:
    """Name of `model`'s param in the unsharded single-stage reference."""
    match = _LAYER_RE.match(name)
    if match:
        global_idx = model.decoder.layers[int(match.group(1))].layer_number - 1
        return _LAYER_RE.sub(f"decoder.layers.{global_idx}.", name)
    if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"  # tied copy on the last stage (PP > 1)
    return name


def _shard(full: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    """This TP rank's slice of a reference tensor, per megatron's param tags."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    assert getattr(param, "partition_stride", 1) == 1
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    return full.chunk(tp, dim=param.partition_dim)[rank]  # e.g. [v/tp, h], [3h/tp, h], [h, 4h/tp]


def _load_reference(model: GPTModel, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_shard(weights[_reference_name(name, model)], param))


def _assert_grads_match(model: GPTModel, grads: dict[str, torch.Tensor]) -> None:
    for name, param in model.named_parameters():
        expected = _shard(grads[_reference_name(name, model)], param)
        torch.testing.assert_close(
            param.main_grad, expected, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}"
        )


def _reference(batches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Unsharded model, loss averaged over `batches`: loss, weights and grads."""
    _init_parallel()
    model = _gpt(_config())
    loss = sum(_lm_loss(model, batch) for batch in batches) / len(batches)
    loss.backward()
    return {
        "loss": loss.detach(),
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
    }


# ------------------------------------------------------------------------- model-parallel checks


def _check_tp(ref: dict[str, Any], batches: list[dict[str, torch.Tensor]], sp: bool) -> None:
    """tp=2 (optionally + SP) GPTModel: same loss and grads as the tp=1 reference."""
    _init_parallel(tp=2)
    config = _config(tp=2, sp=sp)
    model = _gpt(config)
    if sp:
        norm = model.decoder.final_layernorm
        assert isinstance(norm, SPLayerNorm) and norm.weight.sequence_parallel
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    _load_reference(model, ref["weights"])
    loss = sum(_lm_loss(ddp, batch) for batch in batches) / len(batches)
    loss.backward()
    finalize_model_grads([ddp])  # SP: sums the SPNorm grads over tp
    torch.testing.assert_close(loss.detach(), ref["loss"], rtol=RTOL, atol=ATOL)
    _assert_grads_match(model, ref["grads"])


def _forward_step(data_iterator: Iterator[dict], model: torch.nn.Module) -> tuple[Any, Callable]:
    batch = next(data_iterator)
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = output.mean()  # output: [b, s] per-token losses
        # clone: the schedule divides the returned loss in place (schedules.py:269), and a bare
        # detach() shares its storage.
        return loss, {"lm loss": loss.detach().clone()}

    return per_token, loss_func


def _check_pp(ref: dict[str, Any], batches: list[dict[str, torch.Tensor]]) -> None:
    """pp=2 1F1B over megatron's schedule, tied embeddings: loss and grads equal pp=1."""
    _init_parallel(pp=2)
    config = _config(pp=2)
    config.finalize_model_grads_func = finalize_model_grads
    model = _gpt(config)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    _load_reference(model, ref["weights"])
    losses = forward_backward_pipelining_without_interleaving(
        forward_step_func=_forward_step,
        data_iterator=iter(batches),
        model=[ddp],
        num_microbatches=len(batches),
        seq_length=SEQ,
        micro_batch_size=MBS,
    )
    if parallel_state.is_pipeline_last_stage():
        loss = torch.stack([d["lm loss"] for d in losses]).mean()
        torch.testing.assert_close(loss, ref["loss"], rtol=RTOL, atol=ATOL)
    else:
        assert losses == [] or losses == {}, losses
    _assert_grads_match(model, ref["grads"])


def model_parallel_checks(rank: int, world_size: int) -> dict[str, str | None]:
    """Spawn entry: tp2, tp2+sp and pp2 against one unsharded reference."""
    assert world_size == 2
    cpu_compat.apply()
    batches = _batches(NUM_MICROBATCHES, MBS, seed=SEED)
    ref = _reference(batches)
    checks = {
        "tp2": lambda: _check_tp(ref, batches, sp=False),
        "tp2_sp": lambda: _check_tp(ref, batches, sp=True),
        "pp2_1f1b": lambda: _check_pp(ref, batches),
    }
    return _run_checks(checks)


def _run_checks(checks: dict[str, Callable[[], None]]) -> dict[str, str | None]:
    outcomes: dict[str, str | None] = {}
    for name, check in checks.items():
        try:
            check()
            outcomes[name] = None
        except Exception:  # noqa: BLE001 - reported per check to the parent
            outcomes[name] = traceback.format_exc()
    parallel_state.destroy_model_parallel()
    return outcomes


# -------------------------------------------------------------------------- data-parallel checks

NUM_STEPS, LR, CLIP_GRAD = 3, 1e-3, 1.0
# Params after Adam steps: where an element's grad is ~0 (embedding rows of unseen tokens),
# m/sqrt(v) turns fp32 reduction-order noise into O(lr) update differences (observed: one
# element of 8192 off by 6e-6 = 0.006 lr, ~8x under this bound). Allow 0.05 lr; a sharding or
# scaling bug moves most elements by O(lr), and losses and grad norms stay at RTOL/ATOL.
PARAM_ATOL = 0.05 * LR


def _dp_model(weights: dict[str, torch.Tensor]) -> tuple[DistributedDataParallel, Any]:
    """dp=world GPT under DDP (bucketed, overlapped grad reduce) + megatron distributed Adam."""
    config = _config()
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=2000
    )
    ddp = DistributedDataParallel(config, ddp_config, _gpt(config))
    _load_reference(ddp.module, weights)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=LR,
        weight_decay=0.0,
        clip_grad=CLIP_GRAD,
        use_distributed_optimizer=True,
    )
    return ddp, get_megatron_optimizer(opt_config, [ddp])


def _dp_step(ddp: DistributedDataParallel, optimizer: Any, batch: dict) -> list[float]:
    """One step on this rank's slice of the global batch: [global mean loss, grad norm]."""
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    dp, rank = (
        parallel_state.get_data_parallel_world_size(),
        parallel_state.get_data_parallel_rank(),
    )
    local = {k: v.chunk(dp, dim=0)[rank] for k, v in batch.items()}  # [b/dp, s]
    loss = _lm_loss(ddp, local)
    loss.backward()
    finalize_model_grads([ddp])
    update_successful, grad_norm, _ = optimizer.step()
    assert update_successful
    loss = loss.detach().clone()
    torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    return [loss.item() / dp, float(grad_norm)]


def _reference_steps(weights: dict[str, torch.Tensor], batches: list[dict]) -> dict[str, Any]:
    """dp=1 on the full global batch with torch AdamW + norm clipping, megatron's CPU fallback."""
    model = _gpt(_config())
    _load_reference(model, weights)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    history = []
    for batch in batches:
        opt.zero_grad()
        loss = _lm_loss(model, batch)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, CLIP_GRAD)
        opt.step()
        history.append([loss.item(), grad_norm.item()])
    return {
        "history": history,
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _assert_params_match(
    model: GPTModel,
    weights: dict[str, torch.Tensor],
    *,
    rtol: float = RTOL,
    atol: float = PARAM_ATOL,
) -> None:
    for name, param in model.named_parameters():
        expected = _shard(weights[_reference_name(name, model)], param)
        torch.testing.assert_close(
            param.detach(), expected, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}"
        )


def _check_dp_distopt(state: dict[str, Any]) -> None:
    """dp=2 DDP + distributed optimizer, NUM_STEPS Adam steps: losses, grad norms, params = dp=1.

    The grad norm catches a wrong DP grad scale, which Adam's update would hide.
    """
    _init_parallel()  # world 2 -> dp=2
    ref = _reference_steps(state["init_weights"], state["batches"][:NUM_STEPS])
    ddp, optimizer = _dp_model(state["init_weights"])
    history = [_dp_step(ddp, optimizer, batch) for batch in state["batches"][:NUM_STEPS]]
    state.update(ddp=ddp, optimizer=optimizer)  # the checkpoint check starts from here
    torch.testing.assert_close(history, ref["history"], rtol=RTOL, atol=ATOL)
    _assert_params_match(ddp.module, ref["weights"])


def _ckpt_metadata() -> dict[str, Any]:
    """As megatron/training/checkpointing.py::_build_sharded_state_dict_metadata (pitfall 8.3)."""
    return {
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "distrib_optim_sharding_type": "dp_reshardable",  # the default fails in 0.16.1 (8.4)
    }


def _sharded_state(ddp: DistributedDataParallel, optimizer: Any, is_loading: bool) -> dict:
    metadata = _ckpt_metadata()
    model_sd = ddp.module.sharded_state_dict(metadata=metadata)  # .module: no "module." prefix
    optim_sd = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    return {"model": model_sd, "optimizer": optim_sd}


def _check_dist_ckpt(state: dict[str, Any], ckpt_dir: str) -> None:
    """torch_dist save of model + distopt state, load into a fresh model: same next step."""
    ddp, optimizer = state["ddp"], state["optimizer"]
    dist_checkpointing.save(_sharded_state(ddp, optimizer, is_loading=False), ckpt_dir)
    saved = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    next_batch = state["batches"][NUM_STEPS]
    expected = _dp_step(ddp, optimizer, next_batch)

    fresh_weights = {n: torch.randn_like(w) for n, w in state["init_weights"].items()}
    new_ddp, new_optimizer = _dp_model(fresh_weights)
    _materialize_adam_state(new_ddp, new_optimizer)
    loaded = dist_checkpointing.load(_sharded_state(new_ddp, new_optimizer, True), ckpt_dir)
    new_ddp.module.load_state_dict(loaded["model"])
    with torch.no_grad():  # distrib_optimizer.py:940 copy_()s into views of leaf params (8.5)
        new_optimizer.load_state_dict(loaded["optimizer"])
    _restore_adam_step(new_optimizer, NUM_STEPS)
    _assert_params_match(new_ddp.module, saved, rtol=0.0, atol=0.0)  # a round trip is exact
    actual = _dp_step(new_ddp, new_optimizer, next_batch)
    continued = {n: p.detach() for n, p in ddp.module.named_parameters()}
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=0.0)  # same ops, same order
    _assert_params_match(new_ddp.module, continued, rtol=0.0, atol=0.0)


def _materialize_adam_state(ddp: DistributedDataParallel, optimizer: Any) -> None:
    """A zero-grad step, so torch Adam has `state['step']` before `sharded_state_dict`.

    Without apex/TE, DistributedOptimizer.state_dict() (distrib_optimizer.py:640-642) asserts
    one common `step` over the inner torch optimizer's state, which is empty before the first
    step. With zero grads and weight_decay=0 the update is 0, and the load overwrites the rest.
    """
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    optimizer.step()


def _restore_adam_step(optimizer: Any, step: int) -> None:
    """Pitfall 8.5: the dp_reshardable load leaves torch Adam's per-param `state['step']` at its
    pre-load value (1 after `_materialize_adam_state`), so bias correction would be wrong."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for param_state in inner.optimizer.state.values():
            param_state["step"] = torch.full_like(param_state["step"], step)


def data_parallel_checks(rank: int, world_size: int, ckpt_dir: str) -> dict[str, str | None]:
    """Spawn entry: dp2 distopt step, then a dist-ckpt round trip of that state."""
    assert world_size == 2
    cpu_compat.apply()
    _init_parallel()
    state: dict[str, Any] = {
        "init_weights": {n: p.detach().clone() for n, p in _gpt(_config()).named_parameters()},
        "batches": _batches(NUM_STEPS + 1, 2 * MBS, seed=SEED + 1),
    }
    checks = {
        "dp2_distopt": lambda: _check_dp_distopt(state),
        "dist_ckpt": lambda: _check_dist_ckpt(state, ckpt_dir),
    }
    return _run_checks(checks)
