"""Throughput (fastai v2): samples, distinct samples and samples/s per epoch, on 2 ranks (`extras_ranks`) and in one
process."""

import pytest

import ddipp
from extras import digits_dls, digits_learner, throughput_fit
from compare import max_diff


TRAINED = (1797 - 359) // 32 * 32  # digits' training set in full batches of 32: 1408 items


@pytest.mark.slow
def test_two_ranks_process_each_training_item_once_per_epoch(extras_ranks):
    (r0, r1), _ = extras_ranks
    t0, t1 = r0["throughput"], r1["throughput"]
    assert t0["names"][-4:] == ["samples", "distinct", "samples/s", "time"]
    assert t0["values"] == t1["values"]  # identical recorder on every rank
    for epoch in t0["values"]:
        samples, distinct, rate = epoch[-3:]
        assert samples == distinct == TRAINED and rate > 0


@pytest.mark.slow
def test_the_results_table_shows_it_and_the_comparison_is_one_line_on_rank0(extras_ranks):
    _, out = extras_ranks
    rank0, rank1 = ((out / f"stdout{r}.txt").read_text() for r in range(2))
    assert "samples   distinct  samples/s" in rank0 and f" {TRAINED}      {TRAINED} " in rank0
    lines = [line for line in rank0.splitlines() if "ddipp throughput: 2 ranks" in line]
    assert len(lines) == 1 and "1 process" in lines[0] and "(over 4 batches)" in lines[0]
    assert "ddipp throughput" not in rank1


@pytest.mark.slow
def test_the_comparison_leaves_weights_and_order_as_they_were(extras_ranks):
    (r0, _), _ = extras_ranks
    assert max_diff(r0["throughput"]["params"], r0["no_throughput"]) == 0


def test_one_process_and_the_columns_last_only_for_the_fit():
    res = throughput_fit(digits_learner(digits_dls(bs=32, shuffle=True)))
    assert [epoch[-3:-1] for epoch in res["values"]] == [[TRAINED, TRAINED]] * 2
    assert res["metrics_after"] == 0


def test_validate_shows_no_throughput_columns():
    learn = digits_learner(digits_dls(bs=32)).add_cb(ddipp.Throughput())
    learn.validate()
    assert "samples" not in learn.recorder.metric_names and len(learn.final_record) == 1  # the valid loss alone
