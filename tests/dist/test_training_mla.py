"""A multi-latent-attention model through examples/pretrain_gpt.py on 4 gloo ranks.

DeepSeek-V2-Lite's attention shape scaled down (no query latent, kv latent 32, rope head 8,
--qk-layernorm): on megatron-core 0.19 the query is normalised too, through the local fused
norm+linear (megatron_adapter/norm_linear.py), on 0.16.1 it is not; both train. A plain dp4 run
goes through the stock backend (one uniform strategy, nothing for the layerwise runtime to do),
a tp2 + SP run through the layerwise one (MLA heads split over tp, the latents gathered over the
layer's group). Parity with a single process is tests/dist/test_mla_parity.py; this is the drop-in
script end to end. Mock data and the NullTokenizer: nothing to write or download.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = REPO / "examples" / "pretrain_gpt.py"
LOSS = re.compile(r" iteration +(\d+)/ *\d+ \|.* lm loss: ([0-9.E+-]+) \|")
FLAGS = [
    "--cpu", "--transformer-impl", "local", "--num-layers", "2", "--hidden-size", "64",
    "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "64",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--micro-batch-size", "2",
    "--global-batch-size", "8", "--lr", "3e-3", "--log-interval", "1", "--eval-iters", "0",
    "--num-workers", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--multi-latent-attention", "--kv-lora-rank", "32", "--qk-head-dim", "16",
    "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--qk-layernorm", "--train-iters", "4",
]


@pytest.mark.parametrize(("extra", "backend"), [
    ([], "stock"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], None),
])
def test_mla_model_trains_through_pretrain_gpt(extra: list[str], backend: str | None) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "4", str(PRETRAIN), *FLAGS, *extra]
    result = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=900, cwd=REPO)
    assert result.returncode == 0, result.stdout[-4000:]
    if backend is not None:
        assert f"backend: {backend}" in result.stdout, result.stdout[-3000:]
    losses = {int(i): float(loss) for i, loss in LOSS.findall(result.stdout)}
    assert sorted(losses) == [1, 2, 3, 4], result.stdout[-3000:]
    assert losses[4] < losses[1], losses
