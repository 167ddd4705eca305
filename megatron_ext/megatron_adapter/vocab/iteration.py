"""One iteration of vocabulary-parallel 1F1B: executes this stage's planned pass order.

Legend: s = sequence, b = micro-batch, h = hidden, n = s*b tokens (s-major).
Helper of vocab/schedule.py (see its docstring for the contract); each method is one pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import (
    check_first_val_step,
    deallocate_output_tensor,
    forward_step,
    forward_step_calc_loss,
)
from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_attr_wrapped_model, get_model_type

from megatron_ext.megatron_adapter.compat import backward_step
from megatron_ext.megatron_adapter.vocab.layers import (
    VocabParallelLayers,
    VocabScheduleOptions,
)
from megatron_ext.planner.vocab.pass_costs import vocab_pass_costs
from megatron_ext.planner.vocab.schedule_ops import Op, receive_window
from megatron_ext.runtime.vocab.passes import VocabPassRunner


class VocabIteration:
    """State of one forward-backward call on one rank."""

    def __init__(self, *, model: torch.nn.Module, config: Any, p2p: P2PCommunicator,
                 pgc: ProcessGroupCollection, options: VocabScheduleOptions,
                 shape: tuple[int, int, int], batches: list[dict[str, torch.Tensor]],
                 forward_step_func: Callable, forward_only: bool, collect_non_loss_data: bool,
                 first_val_step: bool | None, order_fn: Callable[..., tuple]) -> None:
        if config.sequence_parallel or pgc.cp.size() > 1:
            raise ValueError("vocabulary-parallel 1F1B needs stage boundaries of [s, b, h]: "
                             "turn off sequence_parallel and context parallelism at boundaries")
        self.model, self.config, self.p2p, self.pgc = model, config, p2p, pgc
        self.options = options
        self.recv_shape, self.send_shape = options.p2p_shapes or (shape, shape)  # [s, b, h]
        self.shape = options.hidden_shape or shape  # [s, b, h] of the vocabulary passes
        self.batches, self.m = batches, len(batches)
        self.select = options.select_tokens or (lambda tokens: tokens)  # [b, s] -> [b_loc, s_loc]
        self.step_func, self.forward_only = forward_step_func, forward_only
        self.collect, self.first_val_step = collect_non_loss_data, first_val_step
        pp = p2p.pp_group
        self.first, self.last = is_pp_first_stage(pp), is_pp_last_stage(pp)
        self.model_type = get_model_type(model)
        layers: VocabParallelLayers = get_attr_wrapped_model(model, "vocab")
        dtype = config.pipeline_dtype or layers.output_weight.dtype
        self.runner = VocabPassRunner(
            partition=layers.partition, input_weight=layers.input_weight,
            output_weight=layers.output_weight, groups=options.groups,
            num_barriers=options.num_barriers, num_microbatches=self.m, hidden_shape=self.shape,
            dtype=dtype, is_first_stage=self.first, is_last_stage=self.last,
            forward_only=forward_only,
            receive_window=receive_window(pp.size(), options.num_barriers))
        s, b, h = self.shape
        costs = vocab_pass_costs(
            layers_per_stage=options.layers_per_stage or (1,) * pp.size(), hidden=h,
            ffn_hidden=options.ffn_hidden_size or 4 * h, seq_length=s, tokens=s * b,
            padded_vocab=layers.partition.padded_vocab_size,
            num_shards=layers.partition.num_shards, num_barriers=options.num_barriers)
        self.order: tuple[Op, ...] = order_fn(pp.size(), self.m, options.num_barriers, costs,
                                              forward_only)[pp.rank()]
        self.inputs: dict[int, Any] = {}
        self.outputs: dict[int, Any] = {}
        self.out_grads: dict[int, Any] = {}
        self.in_grads: dict[int, Any] = {}
        self.loss_funcs: dict[int, Callable] = {}
        self.total_num_tokens = torch.zeros([], dtype=torch.int)
        self.forward_data_store: list = []

    def execute(self) -> None:
        dispatch = {"RF": self._recv_forward, "F": self._forward, "SF": self._send_forward,
                    "SFRB": self._send_forward_recv_backward, "B": self._backward,
                    "SB": self._send_backward, "SBRF": self._send_backward_recv_forward,
                    "RB": self._recv_backward, "IF": self._input_forward, "S": self._output,
                    "L": self._loss, "T": self._output_backward, "IB": self._input_backward}
        timer = self.options.pass_timer
        for op in self.order:
            start = time.thread_time() if timer else 0.0
            dispatch[op.kind](op)
            if timer:
                timer(op, time.thread_time() - start)

    # ---- transformer passes and P2P (Megatron's calls) ----------------------------------------

    def _recv_forward(self, op: Op) -> None:
        self.inputs[op.mb] = self.p2p.recv_forward(self.recv_shape, self.first)  # [s, b, h]

    def _forward(self, op: Op) -> None:
        j, captured = op.mb, {}

        def step(iterator: Any, model: torch.nn.Module) -> tuple[Any, Callable]:
            output, loss_func = self.step_func(iterator, model)
            captured["loss_func"] = loss_func
            return output, loss_func

        inp = self.runner.take_embedding(j) if self.first else self.inputs.get(j)
        if self.first:
            self.inputs[j] = inp
        output, _ = forward_step(
            step, iter([self.batches[j]]), self.model, self.m, inp, self.forward_data_store,
            self.config, self.pgc.cp.size(), collect_non_loss_data=self.collect,
            is_first_microbatch=check_first_val_step(self.first_val_step, self.forward_only,
                                                     j == 0),
            current_microbatch=j, is_last_stage=False)  # [s, b, h]; the loss is the L pass
        if self.forward_only and not self.first:
            self.inputs.pop(j, None)
        if self.last:
            self.loss_funcs[j] = captured["loss_func"]
            if self.runner.is_hidden_root:
                self.runner.publish_hidden(j, output)
            deallocate_output_tensor(output, self.config.deallocate_pipeline_outputs)
        if not (self.forward_only and self.last):
            self.outputs[j] = output

    def _send_forward(self, op: Op) -> None:
        output = self.outputs[op.mb] if not self.forward_only else self.outputs.pop(op.mb)
        self.p2p.send_forward(output, self.last)
        deallocate_output_tensor(output, self.config.deallocate_pipeline_outputs)

    def _send_forward_recv_backward(self, op: Op) -> None:
        output = self.outputs[op.mb]
        self.out_grads[op.recv_mb] = self.p2p.send_forward_recv_backward(
            output, self.send_shape, self.last)
        deallocate_output_tensor(output, self.config.deallocate_pipeline_outputs)

    def _backward(self, op: Op) -> None:
        k = op.mb
        output_grad = self.runner.hidden_grad(k) if self.last else self.out_grads.pop(k)
        input_grad = backward_step(self.inputs.pop(k), self.outputs.pop(k), output_grad,
                                   self.model_type, self.config)  # [s, b, h]
        self.in_grads[k] = input_grad

    def _send_backward(self, op: Op) -> None:
        self.p2p.send_backward(self.in_grads.pop(op.mb), self.first)

    def _send_backward_recv_forward(self, op: Op) -> None:
        self.inputs[op.recv_mb] = self.p2p.send_backward_recv_forward(
            self.in_grads.pop(op.mb), self.recv_shape, self.first)

    def _recv_backward(self, op: Op) -> None:
        self.out_grads[op.mb] = self.p2p.recv_backward(self.send_shape, self.last)

    # ---- vocabulary passes --------------------------------------------------------------------

    def _input_forward(self, op: Op) -> None:
        tokens = self.select(self.batches[op.mb]["tokens"]).t().contiguous()  # [b, s] -> [s, b]
        self.runner.input_forward(op.mb, tokens)

    def _input_backward(self, op: Op) -> None:
        grad = self.in_grads.pop(op.mb) if self.first else None  # first stage: dL/d(embedding)
        self.runner.input_backward(op.mb, grad)

    def _output(self, op: Op) -> None:
        labels = self.select(self.batches[op.mb]["labels"]).t().contiguous()  # [b, s] -> [s, b]
        self.runner.output_forward(op.mb, labels)

    def _output_backward(self, op: Op) -> None:
        self.runner.output_backward(op.mb)

    def _loss(self, op: Op) -> None:
        """Last stage: the user's loss function on the per-token losses [b, s]; its gradient
        w.r.t. them (mask, averaging and loss scale included) feeds T and the last B."""
        j, (s, b, _) = op.mb, self.shape
        losses = self.runner.token_losses(j).view(s, b).t()  # [n] -> [b, s]
        leaf = losses.detach().clone().requires_grad_(not self.forward_only)
        output, num_tokens = forward_step_calc_loss(
            self.model, leaf, self.loss_funcs.pop(j), self.config, None, self.collect, self.m,
            self.forward_data_store, self.pgc.cp.size(), is_last_stage=True)
        self.total_num_tokens += num_tokens
        if self.forward_only:
            return
        if self.config.grad_scale_func is not None:
            output = self.config.grad_scale_func(output)
        (grad,) = torch.autograd.grad(output, leaf)  # [b, s]
        self.runner.publish_token_grads(j, grad.t().contiguous().reshape(-1))  # [n]
