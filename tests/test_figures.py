"""The readability rule every ddp-app plot follows (app/figures.py), on the cases that motivated it."""

from __future__ import annotations

from app.figures import fits_one_axis, readable


def test_accuracy_beside_samples_per_second_is_flattened_and_each_alone_is_readable() -> None:
    # Issue 33: train_acc (0.6 to 0.98) drawn on samples_per_s's axis (0 to 40,000) was a line at 0.
    accuracy, samples_per_s = (0.6, 0.98), (8_700.0, 38_000.0)
    assert not readable(*accuracy, 0.0, 40_000.0)
    assert not fits_one_axis([accuracy, samples_per_s], log=False)
    assert fits_one_axis([accuracy], log=False) and fits_one_axis([samples_per_s], log=False)
    assert fits_one_axis([accuracy, (0.86, 0.97)], log=False)  # train and val accuracy share a panel


def test_a_series_that_is_flat_in_fact_may_share_an_axis_that_shows_its_level() -> None:
    # A throughput that does not scale (8676 -> 9059 samples/s) beside the ideal line (up to 48590).
    assert readable(8_676.0, 9_059.0, 0.0, 50_669.0)
    # A flat accuracy is still flattened where the axis cannot show its level.
    assert not readable(0.96, 0.98, 0.0, 50_669.0)
    # On a log axis every level shows: a loss on its plateau beside one that falls 100x.
    assert fits_one_axis([(0.02, 2.0), (0.13, 0.15)], log=True)
    assert not fits_one_axis([(0.02, 2.0), (0.15, 0.22)], log=True)
