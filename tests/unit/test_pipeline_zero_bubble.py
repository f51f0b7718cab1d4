"""The ZB-H1 tables (pipeline_tables.zero_bubble): every operation once, every dependency a tick apart, the
idle share of the paper's formula, below 1F1B's, and buffers bounded by pp, not the micro-batches."""

import pytest

from mjax.parallel.pipeline_tables import one_f_one_b, zero_bubble

CASES = [(2, 2), (2, 4), (2, 16), (3, 3), (3, 7), (4, 4), (4, 8), (4, 16), (8, 8), (8, 20)]


def _ticks(tables, op, s):
    """{micro-batch: tick} of device s's `op` ("f", "b" or "w")."""
    return {int(m): t for t, m in enumerate(getattr(tables, f"{op}_micro")[:, s]) if m >= 0}


@pytest.mark.parametrize("pp, num", CASES)
def test_every_operation_once_after_what_it_needs(pp, num):
    tables = zero_bubble(pp, num)
    busy = sum((getattr(tables, f"{op}_micro") >= 0).astype(int) for op in "fbw")
    assert busy.max() == 1  # one operation per device per tick
    for s in range(pp):
        f, b, w = (_ticks(tables, op, s) for op in "fbw")
        assert len(f) == len(b) == len(w) == num and set(f) == set(b) == set(w) == set(range(num))
        assert all(f[m] < b[m] < w[m] for m in range(num))  # W after its own B
        if s > 0:  # a forward needs the previous device's forward a tick before
            prev = _ticks(tables, "f", s - 1)
            assert all(prev[m] < f[m] for m in range(num))
        if s < pp - 1:  # B needs the next device's B a tick before
            nxt = _ticks(tables, "b", s + 1)
            assert all(nxt[m] < b[m] for m in range(num))


@pytest.mark.parametrize("pp, num", CASES)
def test_bubble_is_a_third_of_1f1b_in_its_ticks(pp, num):
    tables = zero_bubble(pp, num)
    idle = (pp * len(tables.f_micro) - 3 * pp * num) / (pp * len(tables.f_micro))
    assert tables.bubble() == pytest.approx(idle, abs=1e-12)
    assert len(tables.f_micro) == 3 * num + pp - 1  # each device idles pp - 1 ticks: (pp - 1) / (3 M + pp - 1)
    assert tables.bubble() < one_f_one_b(pp, 1, num).bubble()


def _replay(tables):
    """The buffers' contents tick by tick from the slot columns alone: checks each read finds what it expects and
    returns the most slots of each buffer in use at once, per device."""
    pp = tables.f_micro.shape[1]
    peak = {k: 0 for k in ("received", "grads", "stash", "kept")}
    held = [{k: {} for k in peak} for _ in range(pp)]  # device -> buffer -> slot -> micro-batch
    for t in range(len(tables.f_micro)):
        for s in range(pp):
            if tables.f_arrive[t, s] >= 0:  # the previous device's forward of last tick
                held[s]["received"][int(tables.f_arrive[t, s])] = int(tables.f_micro[t - 1, s - 1])
            if tables.b_arrive[t, s] >= 0:
                held[s]["grads"][int(tables.b_arrive[t, s])] = int(tables.b_micro[t - 1, s + 1])
            for k in ("received", "grads"):  # an arrival may be used in the tick it arrives
                peak[k] = max(peak[k], len(held[s][k]))
        for s in range(pp):
            h = held[s]
            if (m := tables.f_micro[t, s]) >= 0:
                assert (tables.f_input[t, s] < 0) == (s == 0)
                if s > 0:
                    assert h["received"].pop(int(tables.f_input[t, s])) == m
                assert int(tables.f_stash[t, s]) not in h["stash"]
                h["stash"][int(tables.f_stash[t, s])] = int(m)
            if (m := tables.b_micro[t, s]) >= 0:
                assert (tables.b_input[t, s] < 0) == (s == pp - 1)
                if s < pp - 1:
                    assert h["grads"].pop(int(tables.b_input[t, s])) == m
                assert h["stash"][int(tables.b_stash[t, s])] == m
                assert int(tables.b_keep[t, s]) not in h["kept"]
                h["kept"][int(tables.b_keep[t, s])] = int(m)
            if (m := tables.w_micro[t, s]) >= 0:
                assert h["stash"].pop(int(tables.w_stash[t, s])) == m
                assert h["kept"].pop(int(tables.w_keep[t, s])) == m
            for k in ("stash", "kept"):
                peak[k] = max(peak[k], len(h[k]))
    assert all(not v for h in held for v in h.values())  # everything used
    return peak


@pytest.mark.parametrize("pp, num", CASES)
def test_buffers_hold_what_each_read_expects_and_stay_bounded_by_pp(pp, num):
    tables = zero_bubble(pp, num)
    peak = _replay(tables)
    assert peak == {k: getattr(tables, k) for k in peak}
    # The inputs waiting for their W: as many as 1F1B's tables keep for their backward (at most 2 pp - 1); the
    # gradients kept for W belong to some of them.
    assert tables.stash == one_f_one_b(pp, 1, num).stash <= 2 * pp - 1
    assert tables.kept <= tables.stash
    assert tables.received == tables.grads == 1
    more = zero_bubble(pp, 4 * num)
    assert (more.stash, more.kept) == (tables.stash, tables.kept) or num < 2 * pp  # flat once M >= 2 pp


def test_phases_cover_the_ticks_with_the_kinds_run_in_them():
    tables = zero_bubble(4, 16)
    spans = tables.phases()
    assert [a for *_, a, _ in spans][0] == 0 and spans[-1][-1] == len(tables.f_micro)
    assert all(spans[i][-1] == spans[i + 1][-2] for i in range(len(spans) - 1))
    for *kinds, a, b in spans:
        assert kinds == [bool((getattr(tables, f"{op}_micro")[a:b] >= 0).any()) for op in "fbw"]


def test_fewer_micro_batches_than_stages_is_refused():
    with pytest.raises(ValueError, match="at least --pp=4 micro-batches"):
        zero_bubble(4, 3)
