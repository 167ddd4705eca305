"""A checkpoint written under megatron-core 0.16.1 resumes under the installed megatron-core.

tests/data/ckpt_mcore016/ holds a checkpoint that examples/pretrain_gpt.py saved at iteration 3
under megatron-core 0.16.1 (2 gloo ranks, tiny fp32 GPT, distributed optimizer, cosine schedule),
the corpus it was trained on, and the losses of iterations 4-6 of that same uninterrupted run
(`reference.json`; tests/data/make_mcore016_checkpoint.py rebuilds all of it). Here the same
command resumes it under whatever megatron-core is installed (0.16.1 on the first CI leg, 0.19.x
on the second) and must log the same losses for iterations 4-6: weights, Adam moments, the
scheduler and the data position all came through.

Tolerance: rel 1e-5 per loss. Under the version that wrote it the resume is bit for bit (same
code, same reductions). Under another megatron-core or another torch build the math is the same
fp32 GEMMs and gloo sums, but a kernel or bucket order may differ: a few float32 ulps (~1e-7
relative) per step over 3 steps. A lost Adam moment or a misplaced shard moves the iteration-5
loss by >1e-3 relative.

The resumed run saves at its end, and `megatron-ext checkpoint inspect` reads that save: under
0.19 the common state lives inside the torch_dist files (no common.pt), under 0.16.1 beside them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "data" / "ckpt_mcore016"
LOSS_LINE = re.compile(r" iteration +(\d+)/ *\d+ \|.* lm loss: ([0-9.E+-]+) \|")
REL = 1e-5  # see the module docstring


def test_megatron_core_016_checkpoint_resumes_here(tmp_path: Path) -> None:
    reference = json.loads((FIXTURE / "reference.json").read_text())
    root = tmp_path / "fixture"
    shutil.copytree(FIXTURE, root)  # megatron-core writes its dataset index cache beside the data
    data = ["--data-path", str(root / "corpus_text_document"), "--tokenizer-type",
            "GPT2BPETokenizer", "--vocab-file", str(root / "gpt2-vocab.json"),
            "--merge-file", str(root / "gpt2-merges.txt")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(reference["nproc"]), str(REPO / "examples" / "pretrain_gpt.py"),
           *reference["flags"], *data, "--load", str(root / "checkpoint"),
           "--save", str(tmp_path / "saved"), "--save-interval", "100"]
    result = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=900, cwd=REPO, env=dict(os.environ))
    assert result.returncode == 0, result.stdout[-4000:]
    saved = f"iter_{reference['saved_at']:07d}"
    assert f"loaded {root / 'checkpoint' / saved}: weights restored; optimizer state restored; " \
        "learning-rate schedule restored" in result.stdout, result.stdout[-3000:]
    losses = {int(i): loss for i, loss in LOSS_LINE.findall(result.stdout)}
    expected = {int(i): loss for i, loss in reference["losses"].items()}
    assert sorted(losses) == sorted(expected), result.stdout[-3000:]
    for i, loss in expected.items():
        assert float(losses[i]) == pytest.approx(float(loss), rel=REL), (i, losses[i], loss)

    from megatron.core import package_info

    from megatron_ext.commands.checkpoint import inspect_checkpoint
    from megatron_ext.megatron_adapter.compat_versions import version_at_least

    legacy_common = not version_at_least(package_info.__version__, (0, 17, 0))
    assert (tmp_path / "saved" / "iter_0000006" / "common.pt").is_file() == legacy_common
    record = inspect_checkpoint(tmp_path / "saved")  # saved by the installed megatron-core
    assert record["iteration"] == record["tracker_iteration"] == 6, record
    assert record["intact"] and record["manifest"], record
    assert record["megatron_core_version"] == package_info.__version__, record
    assert record["written_by"] == "megatron_ext" and record["plan"]["world_size"] == 2, record
    assert record["optimizer_state"] and record["optimizer_step"] == 6, record
    assert record["model_tensors"] > 0 and record["optimizer_tensors"]["exp_avg"] > 0, record
