"""Calibration of the GPU cost model on published training runs (torch-free).

  sources.py    where the inputs are (tools/data/, development inputs) and the copy checks
  vtrain.py     vTrain's measured sweeps (CSV) -> rows;  lucie.py: Lucie-7B's table -> rows
  inputs.py     every row of a benchmark run: the published file, vTrain and Lucie
  rows.py       one row -> Megatron-LM flags, plan, cluster, execution settings, measured time
  scoring.py    predict (what `megatron-ext evaluate` scores) and the benchmark run
  ranking.py    Spearman, top-1 regret, sweeps and their summaries
  residuals.py  held-out refit of gemm_efficiency, the interval's residual table
  report.py     the benchmark's printed report
  host_fit.py   fitting the host constants on the measured sweeps (fast exact path)
  tp_gap.py     what-if candidates for the tensor-parallel gap on Jean Zay
  load_check.py load detection for CPU benchmarks on a shared machine

The command-line wrappers are tools/bench_published.py, tools/fit_gpu_constants.py and
tools/bench_tp_gap.py.
"""
