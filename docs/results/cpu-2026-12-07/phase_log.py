"""pytest plugin (-p phase_log): per test, one JSON line into phases.jsonl with the seconds of each jax.monitoring
duration event (jaxpr tracing, lowering to StableHLO, backend compile). Summarised in suite_time.txt."""
import collections
import json

import jax
import pytest

_seconds: collections.Counter = collections.Counter()
_log = open("phases.jsonl", "a")


def _add(event, seconds, **_):
    _seconds[event.rsplit("/", 1)[-1]] += seconds


jax.monitoring.register_event_duration_secs_listener(_add)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _seconds.clear()
    yield
    _log.write(json.dumps(dict(test=item.nodeid, **_seconds)) + "\n")
    _log.flush()
