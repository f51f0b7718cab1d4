"""benchmarks/profile.py's step table: a trace's kernels split into steps, each kernel's running and idle time
averaged over the steps (synthetic events, in ns)."""

import pytest

from benchmarks.profile import step_table


def test_kernels_split_into_steps_with_the_idle_time_before_each():
    steps = [[("a", 0, 1_000_000), ("b", 1_500_000, 4_500_000), ("c", 4_500_000, 5_000_000)],
             [("a", 9_000_000, 10_000_000), ("b", 10_100_000, 13_100_000), ("c", 13_400_000, 14_400_000)]]
    rows, span = step_table([e for step in steps for e in step], 2)
    assert [name for name, *_ in rows] == ["a", "b", "c"]
    assert rows[0][1:] == pytest.approx((1.0, 0.0))  # the gap between steps is not counted
    assert rows[1][1:] == pytest.approx((3.0, 0.3))
    assert rows[2][1:] == pytest.approx((0.75, 0.15))
    assert span == pytest.approx(5.2)


def test_a_trace_that_does_not_split_into_the_steps_is_refused():
    with pytest.raises(ValueError, match="do not split into 2 steps"):
        step_table([("a", 0, 1), ("b", 1, 2), ("c", 2, 3)], 2)
    with pytest.raises(ValueError, match="launched different kernels"):
        step_table([("a", 0, 1), ("b", 1, 2), ("a", 5, 6), ("c", 6, 7)], 2)
