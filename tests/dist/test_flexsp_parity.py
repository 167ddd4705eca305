"""FlexSP runtime parity on 4 gloo ranks (one spawn, several checks).

Model: megatron-core `TransformerLayer`s from the local GPT spec (RMSNorm, SwiGLU, RoPE, GQA:
4 query heads, 2 kv heads) whose core attention is `FlexSPCoreAttention` (Ulysses + packed
varlen attention), between a torch embedding and output layer, all fp64. Reference: the same
weights in stock megatron layers (local `DotProductAttention`, causal mask) run on one rank, one
sequence at a time, loss = mean over all labelled tokens. FlexSP: the step's sequences loaded
round-robin, dispatched by plan, packed per group, token-level loss, one gradient all-reduce.

Plans: a hand-made one hitting every path (degree 4 > 2 kv heads: kv replicated; degree 2:
kv split; degree 1; an idle group; sequences straddling ranks; a group with barely more tokens
than ranks) and one from the fast planner on random lengths.

Full GPT, in the same spawn (fp32): megatron-core `GPTModel` (embedding, RoPE, TransformerBlock,
final norm, output layer, its own per-token cross-entropy) as `FlexSPGPTModel` under
megatron-core `DistributedDataParallel` over the world, against a stock `GPTModel` with the same
weights run one sequence at a time (positions 0..s-1 each, so per-sequence RoPE is checked).
Case "ddp": planner plan on long-tailed lengths; every gradient in DDP's buffers. Case "zero1" (tied
embedding and output weights, so one parameter gets two gradient contributions):
distributed optimizer (megatron Adam; ZeRO-1 supports only Adam) + overlapped, bucketed grad reduction
on a hand plan where
ranks go idle at different micro-batches and rank 3 idles the whole step; every updated weight.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ext.runtime.testing import run_distributed

pytestmark = pytest.mark.dist

WORLD = 4
HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, VOCAB = 4, 2, 8, 64, 2, 53
HIDDEN = HEADS * HEAD_DIM
IGNORE = -100


class TinyGPT(torch.nn.Module):
    """Embedding -> megatron TransformerLayers -> RMSNorm -> output; packed tokens, batch 1."""

    def __init__(self, layer_spec, config, pg_collection) -> None:
        from megatron.core.transformer.spec_utils import build_module

        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList(
            build_module(layer_spec, config=config, layer_number=i + 1,
                         pg_collection=pg_collection) for i in range(LAYERS))
        self.norm = torch.nn.RMSNorm(HIDDEN, eps=1e-5)
        self.out = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,  # [t], [t]
                packed_seq_params=None) -> torch.Tensor:
        inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM)  # [d/2]
        freqs = positions[:, None] * inv_freq[None, :]  # [t, d/2]
        rope = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [t, 1, 1, d] megatron layout
        h = self.embed(tokens).unsqueeze(1)  # [t, 1, h]
        for layer in self.layers:
            h, _ = layer(h, attention_mask=None, rotary_pos_emb=rope,
                         packed_seq_params=packed_seq_params)
        return self.out(self.norm(h.squeeze(1)))  # [t, v]


def _config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=KV_HEADS, kv_channels=HEAD_DIM, ffn_hidden_size=FFN,
        params_dtype=torch.float64, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, add_bias_linear=False, gated_linear_unit=True,
        activation_func=F.silu, normalization="RMSNorm")


def _hand_plan(lengths: list[int]):
    from megatron_ext.planner.flexsp.step_plan import MicroBatchPlan, SPGroup, StepPlan

    def mb(*groups: tuple[int, int, tuple[int, ...]]) -> MicroBatchPlan:
        return MicroBatchPlan(groups=tuple(SPGroup(start_rank=s, degree=d, seq_ids=ids)
                                           for s, d, ids in groups), predicted_time_s=0.0)

    plan = StepPlan(lengths=tuple(lengths), num_gpus=WORLD, predicted_time_s=0.0, microbatches=(
        mb((0, 4, (0, 1))),  # degree 4 > kv heads: replicated kv; 42 tokens cut 10/11/10/11
        mb((0, 2, (2, 3)), (2, 1, (4,)), (3, 1, (5,))),  # degree 2: kv heads split
        mb((0, 2, (6,)), (2, 2, ())),  # an idle group
        mb((0, 4, (7,))),  # 5 tokens on 4 ranks: 1/1/1/2
    ))
    plan.check()
    return plan


def _planner_plan(lengths: list[int]):
    from megatron_ext.planner.flexsp import FlexSPCostModel, plan_step

    cost = FlexSPCostModel(
        num_gpus=WORLD, gpus_per_node=2, attn_s_per_token_sq=1e-6, linear_s_per_token=1e-4,
        fixed_s_per_microbatch=1e-3, a2a_bytes_per_token_qo=4e3,
        a2a_bytes_per_token_per_kv_head=1e3, num_query_groups=KV_HEADS,
        num_attention_heads=HEADS, num_layers=LAYERS, intra_bandwidth_bytes_per_s=1e9,
        inter_bandwidth_bytes_per_s=1e8, intra_latency_s=1e-6, inter_latency_s=1e-5,
        act_bytes_per_token=1.0, model_state_bytes=0.0, memory_budget_bytes=40.0)
    plan = plan_step(lengths, cost)
    plan.check(capacity_tokens=cost.capacity_tokens)
    assert len({g.degree for mb in plan.microbatches for g in mb.groups}) > 1, plan.summary()
    return plan


def _setup_megatron(rank: int):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_ext.megatron_adapter.cpu import compat as cpu_compat

    # stock DotProductAttention (the reference) needs these on CPU; FlexSP attention does not
    cpu_compat.apply(["current_device", "causal_mask", "rng"])
    parallel_state._set_global_memory_buffer()
    tensor_parallel.get_cuda_rng_tracker().add("model-parallel-rng", 1234)
    own, _ = dist.new_subgroups_by_enumeration([[r] for r in range(WORLD)])
    return ProcessGroupCollection(tp=own, cp=own, pp=own)


def _sequences(lengths: list[int]) -> list[torch.Tensor]:
    """[s, 2] rows (input id, label) per sequence; a few labels ignored."""
    gen = torch.Generator().manual_seed(11)
    rows = []
    for s in lengths:
        ids = torch.randint(0, VOCAB, (s + 1,), generator=gen)
        labels = ids[1:].clone()
        labels[torch.rand(s, generator=gen) < 0.1] = IGNORE
        rows.append(torch.stack([ids[:-1], labels], dim=1))
    return rows


def _reference(model: TinyGPT, seqs: list[torch.Tensor]) -> tuple[torch.Tensor, list]:
    """Mean token loss and grads, one sequence at a time on this rank."""
    model.zero_grad()
    num = sum(int((r[:, 1] != IGNORE).sum()) for r in seqs)
    total = torch.zeros((), dtype=torch.float64)
    for rows in seqs:
        logits = model(rows[:, 0], torch.arange(rows.shape[0], dtype=torch.float64))
        loss = F.cross_entropy(logits, rows[:, 1], ignore_index=IGNORE, reduction="sum") / num
        loss.backward()
        total += loss.detach()
    return total, [p.grad.clone() for p in model.parameters()]


def _flexsp_step(model: TinyGPT, plan, seqs: list[torch.Tensor], rank: int,
                 groups) -> torch.Tensor:
    from megatron_ext.megatron_adapter.flexsp.attention import flexsp_packed_seq_params
    from megatron_ext.runtime.flexsp import (
        allreduce_gradients,
        dispatch_sequences,
        global_token_count,
        position_ids,
        rank_microbatches,
        round_robin_owners,
        run_microbatches,
    )

    model.zero_grad()
    owners = round_robin_owners(len(seqs), WORLD)
    local = {i: seqs[i] for i in range(len(seqs)) if owners[i] == rank}
    parts = dispatch_sequences(plan, rank, local, owners, columns=2)
    views = rank_microbatches(plan, rank)
    for view, part in zip(views, parts):  # dispatch delivered exactly this rank's pieces
        expect = [seqs[s][lo:hi] for s, lo, hi in view.pieces] if view else None
        assert (part is None) == (view is None)
        if view:
            assert torch.equal(part, torch.cat(expect) if expect else part[:0]), view

    def loss_fn(view, rows, group):
        psp = flexsp_packed_seq_params(view, group)
        logits = model(rows[:, 0], position_ids(view).to(torch.float64), psp)
        return F.cross_entropy(logits, rows[:, 1], ignore_index=IGNORE, reduction="sum")

    num = global_token_count(parts, label_column=1, ignore_index=IGNORE)
    share = run_microbatches(views, parts, loss_fn, groups=groups, num_loss_tokens=num)
    dist.all_reduce(share)
    allreduce_gradients(model.parameters())
    return share


def _check_flexsp(rank: int, world_size: int) -> dict[str, float]:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_ext.megatron_adapter.flexsp.attention import flexsp_layer_spec
    from megatron_ext.runtime.flexsp import FlexSPGroups

    torch.set_default_dtype(torch.float64)
    pg = _setup_megatron(rank)
    groups = FlexSPGroups(max_degree=WORLD)
    assert groups.num_communicators == 3  # [0,2) [2,4) and the world
    torch.manual_seed(7)
    model = TinyGPT(flexsp_layer_spec(normalization="RMSNorm"), _config(), pg)
    reference = TinyGPT(get_gpt_layer_local_spec(normalization="RMSNorm"), _config(), pg)
    reference.load_state_dict(model.state_dict())
    hand_lengths = [37, 5, 23, 11, 9, 17, 29, 5]
    gen = torch.Generator().manual_seed(5)
    random_lengths = torch.randint(1, 70, (12,), generator=gen).tolist()
    worst = {}
    for name, lengths, plan in (("hand", hand_lengths, _hand_plan(hand_lengths)),
                                ("planner", random_lengths, _planner_plan(random_lengths))):
        seqs = _sequences(lengths)
        ref_loss, ref_grads = _reference(reference, seqs)
        loss = _flexsp_step(model, plan, seqs, rank, groups)
        # fp64; only the summation order differs (per-group packing, the all-reduce over ranks),
        # so agreement is ~1e-15 relative; 1e-11 / 1e-9 leave room without hiding a wrong term.
        torch.testing.assert_close(loss, ref_loss, rtol=1e-11, atol=1e-13)
        for (pname, p), g in zip(model.named_parameters(), ref_grads):
            torch.testing.assert_close(p.grad, g, rtol=1e-9, atol=1e-12, msg=f"{name} {pname}")
        worst[name] = max(float((p.grad - g).abs().max()) for p, g in
                          zip(model.parameters(), ref_grads))
    torch.set_default_dtype(torch.float32)
    worst.update(_check_gpt(rank))
    return worst


GPT_VOCAB, GPT_MAX_LEN, LR, ADAM_EPS = 61, 256, 0.5, 1.0
# fp32. FlexSP changes only summation orders (packing, per-group attention, DDP bucket sums over
# 4 ranks): losses agree to ~1e-7 relative, gradients and updated weights to ~1e-8 absolute
# (largest seen 7.5e-9, grads of size ~1e-2). 1e-5 relative / 1e-6 absolute leave ~100x
# headroom; a wrong position, a missing or doubled token, or a wrong scale is an O(1) error.
GPT_RTOL, GPT_ATOL = 1e-5, 1e-6


def _gpt_config():
    return dataclasses.replace(_config(), params_dtype=torch.float32, num_query_groups=KV_HEADS,
                               calculate_per_token_loss=True)


def _gpt_sequences(lengths: list[int]) -> list[torch.Tensor]:
    """[s, 3] rows (input id, label, loss mask) per sequence; ~10% of tokens masked."""
    gen = torch.Generator().manual_seed(13)
    rows = []
    for s in lengths:
        ids = torch.randint(0, GPT_VOCAB, (s + 1,), generator=gen)
        mask = (torch.rand(s, generator=gen) >= 0.1).long()
        rows.append(torch.stack([ids[:-1], ids[1:], mask], dim=1))
    return rows


def _gpt_reference(model, seqs: list[torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    num = sum(int(r[:, 2].sum()) for r in seqs)
    total = 0.0
    for rows in seqs:
        s = rows.shape[0]
        losses = model(rows[:, 0][None], torch.arange(s)[None], None, labels=rows[:, 1][None])
        loss = (losses.reshape(-1) * rows[:, 2].float()).sum() / num  # [1, s] -> scalar
        loss.backward()
        total += float(loss)
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def _gpt_ddp(state: dict, *, zero1: bool):  # zero1 also ties the embeddings
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ext.megatron_adapter.flexsp.model import build_flexsp_gpt

    config = _gpt_config()
    model = build_flexsp_gpt(config, vocab_size=GPT_VOCAB, max_sequence_length=GPT_MAX_LEN,
                             tied_embeddings=zero1)
    model.load_state_dict(state)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=zero1, overlap_grad_reduce=zero1, bucket_size=3000)
    ddp = DistributedDataParallel(config, ddp_config, model)
    if not zero1:
        return ddp, None
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=LR, weight_decay=0.0, adam_eps=ADAM_EPS, clip_grad=0.0,
        use_distributed_optimizer=True), [ddp])
    return ddp, opt


def _zero1_plan(lengths: list[int]):
    from megatron_ext.planner.flexsp.step_plan import MicroBatchPlan, SPGroup, StepPlan

    def mb(*groups: tuple[int, int, tuple[int, ...]]) -> MicroBatchPlan:
        return MicroBatchPlan(groups=tuple(SPGroup(start_rank=s, degree=d, seq_ids=ids)
                                           for s, d, ids in groups), predicted_time_s=0.0)

    plan = StepPlan(lengths=tuple(lengths), num_gpus=WORLD, predicted_time_s=0.0, microbatches=(
        mb((0, 2, (0, 1)), (2, 1, (2,)), (3, 1, ())),
        mb((0, 1, (3,)), (1, 1, (4,)), (2, 2, ())),  # ranks 2, 3 idle from here on
        mb((0, 2, (5,)), (2, 2, ())),
    ))
    plan.check()
    return plan


def _check_gpt(rank: int) -> dict[str, float]:
    import numpy as np
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_ext.megatron_adapter.cpu import compat as cpu_compat
    from megatron_ext.megatron_adapter.flexsp.model import flexsp_step
    from megatron_ext.planner.flexsp import sample_lengths
    from megatron_ext.runtime.flexsp import FlexSPGroups, round_robin_owners

    cpu_compat.apply()  # megatron's optimizers and DDP need all of them on CPU
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(distributed_timeout_minutes=1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    references, states = {}, {}
    for tied in (False, True):
        torch.manual_seed(3)
        references[tied] = GPTModel(
            _gpt_config(), get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=GPT_VOCAB, max_sequence_length=GPT_MAX_LEN,
            position_embedding_type="rope", share_embeddings_and_output_weights=tied)
        states[tied] = {k: v.clone() if torch.is_tensor(v) else v
                        for k, v in references[tied].state_dict().items()}
    groups = FlexSPGroups(max_degree=WORLD)
    # long-tailed: Wikipedia's length distribution scaled down 40x (most sequences a few tokens,
    # a tail to ~160 that needs a group of 4 under the planner's 40-token capacity)
    wiki = sample_lengths("wikipedia", 16, max_length=6000, rng=np.random.default_rng(3))
    tailed = [max(1, int(x) // 40) for x in wiki]
    worst: dict[str, float] = {}
    for case, lengths in (("ddp", tailed), ("zero1", [70, 9, 31, 44, 3, 57])):
        plan = _planner_plan(lengths) if case == "ddp" else _zero1_plan(lengths)
        seqs = _gpt_sequences(lengths)
        state = states[case == "zero1"]
        ref_loss, ref_grads = _gpt_reference(references[case == "zero1"], seqs)
        ddp, opt = _gpt_ddp(state, zero1=case == "zero1")
        owners = round_robin_owners(len(seqs), WORLD)
        local = {i: seqs[i] for i in range(len(seqs)) if owners[i] == rank}
        ddp.zero_grad_buffer()
        loss = flexsp_step(ddp, plan, local, owners, groups=groups)
        torch.testing.assert_close(loss, ref_loss, rtol=GPT_RTOL, atol=0.0)
        if opt is None:
            got = {n: p.main_grad for n, p in ddp.module.named_parameters()}
            want = ref_grads
        else:
            ok, _, _ = opt.step()
            assert ok
            got = dict(ddp.module.named_parameters())
            # Adam's first step: lr * g / (|g| + eps); eps = 1 keeps it ~linear in g
            want = {n: state[n] - LR * g / (g.abs() + ADAM_EPS) for n, g in ref_grads.items()}
        assert set(got) == set(want), sorted(set(got) ^ set(want))
        for name, g in want.items():
            torch.testing.assert_close(got[name].detach(), g, rtol=GPT_RTOL, atol=GPT_ATOL,
                                       msg=f"{case} {name}")
        worst[case] = max(float((got[n].detach() - g).abs().max()) for n, g in want.items())
    return worst


def test_flexsp_step_matches_single_process_reference() -> None:
    results = run_distributed(_check_flexsp, world_size=WORLD, timeout_s=300)
    assert all(r["hand"] < 1e-9 and r["planner"] < 1e-9 for r in results), results
    assert all(r["ddp"] < GPT_ATOL and r["zero1"] < GPT_ATOL for r in results), results
