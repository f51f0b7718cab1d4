"""pytest plugin: logs (cache key, seconds, test) of every XLA compile, to find duplicate compiles."""
import os, time, json
from jax._src import compiler, cache_key

_current = ["?"]
_out = open(f"compile_log_{os.getpid()}.jsonl", "a")
_orig = compiler.compile_or_get_cached


def wrapped(backend, computation, devices, compile_options, host_callbacks, executable_devices, *a, **k):
    try:
        key = cache_key.get(computation, devices, compile_options, backend)
    except Exception as e:
        key = "err:" + type(e).__name__
    t = time.perf_counter()
    r = _orig(backend, computation, devices, compile_options, host_callbacks, executable_devices, *a, **k)
    _out.write(json.dumps([key, time.perf_counter() - t, _current[0]]) + "\n"); _out.flush()
    return r


compiler.compile_or_get_cached = wrapped


def pytest_runtest_setup(item):
    _current[0] = item.nodeid
