"""Prediction intervals (planner/cost/interval.py): the quantile rule and how unseen features
widen the interval."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_ext.planner.cost import interval as iv


def test_quantile_matches_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 30):
        v = list(rng.normal(size=n))
        for q in (0.0, 0.05, 0.5, 0.95, 1.0):
            assert iv.quantile(v, q) == pytest.approx(float(np.quantile(v, q)))


def _feats(**kw):
    base = dict(num_gpus=64, micro_batch_size=1, pp=8, precision="fp16", cluster="a")
    return iv.plan_features(**{**base, **kw})


def test_envelope_of_the_groups_and_unseen_features_take_the_extremes():
    """One source: no offset spread, the interval is the envelope of the groups' quantiles."""
    runs = [(_feats(cluster="a"), r, "s") for r in (-0.1, 0.0, 0.05, 0.1)]
    runs += [(_feats(cluster="b", micro_batch_size=8), r, "s") for r in (-0.3, 0.2, 0.25, 0.3)]
    table = iv.build_table(runs)
    lo, hi, unseen = iv.log_bounds(table, _feats(cluster="a"))
    # scale/pipeline/precision groups hold all 8 runs, so the envelope is theirs
    assert lo == pytest.approx(iv.quantile([r for _, r, _ in runs], 0.05))
    assert hi == pytest.approx(iv.quantile([r for _, r, _ in runs], 0.95))
    assert unseen == []
    lo2, hi2, unseen2 = iv.log_bounds(table, _feats(cluster="h100"))
    assert unseen2 == ["cluster=h100"]
    assert (lo2, hi2) == (-0.3, 0.3)  # the extremes of all runs
    assert lo2 <= lo and hi2 >= hi


def test_source_offsets_widen_the_interval_for_an_unseen_source():
    """Three sources whose runs agree inside each source but are offset from one another: the
    interval is centred on the median offset and as wide as the offsets' spread (a new source
    may sit anywhere among them), not as narrow as one source's own scatter."""
    within = (-0.02, -0.01, 0.0, 0.01, 0.02)
    runs = [(_feats(), mu + e, src) for src, mu in (("A", -0.2), ("B", 0.0), ("C", 0.3))
            for e in within]
    table = iv.build_table(runs)
    assert table["sources"]["median"] == pytest.approx(0.0)
    lo, hi, unseen = iv.log_bounds(table, _feats())
    assert unseen == []
    w = iv.quantile(list(within) * 3, 0.95)
    s_low, s_high = -iv.quantile([-0.2, 0.0, 0.3], 0.05), iv.quantile([-0.2, 0.0, 0.3], 0.95)
    assert lo == pytest.approx(-np.hypot(w, s_low))
    assert hi == pytest.approx(np.hypot(w, s_high))
    assert hi - lo > 0.4  # the offsets' spread, not the 0.04 of one source's runs


def test_shipped_table_gives_an_interval_around_the_prediction():
    low, high, unseen = iv.prediction_interval(
        10.0, num_gpus=512, micro_batch_size=1, pp=8, precision="fp16", cluster="dgx-a100-80g")
    assert unseen == ()
    assert low < 10.0 < high
    # an H100 preset has no measured run: wider than the A100 one
    low_h, high_h, unseen_h = iv.prediction_interval(
        10.0, num_gpus=512, micro_batch_size=1, pp=8, precision="fp16", cluster="dgx-h100")
    assert unseen_h == ("cluster=dgx-h100",)
    assert high_h - low_h > high - low
