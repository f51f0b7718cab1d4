"""pytest plugin (-p compile_hash_log): one JSON line per XLA backend compile into compile_hash_log.jsonl: the test,
the program's name, a hash of its StableHLO bytecode with its compile options and devices, the seconds, and
whether that hash was compiled before in this process. Summarised in suite_time.txt."""
import hashlib
import json
import os
import time

import jax._src.compiler as compiler  # private: the one function every compile goes through
import pytest

_compile = compiler.backend_compile_and_load
_seen: set = set()
_log = open("compile_hash_log.jsonl", "a")
_test = ["?"]


def _logged(backend, computation, executable_devices, compile_options, host_callbacks, *args, **kwargs):
    start = time.perf_counter()
    out = _compile(backend, computation, executable_devices, compile_options, host_callbacks, *args, **kwargs)
    seconds = time.perf_counter() - start
    h = hashlib.sha1(computation.operation.get_asm(binary=True, enable_debug_info=False))
    h.update(compile_options.SerializeAsString())
    h.update(str([d.id for d in executable_devices]).encode())
    key = h.hexdigest()
    _log.write(json.dumps(dict(test=_test[0], name=str(computation.operation.attributes["sym_name"]), key=key,
                               s=seconds, dup=key in _seen, pid=os.getpid())) + "\n")
    _log.flush()
    _seen.add(key)
    return out


compiler.backend_compile_and_load = _logged


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _test[0] = item.nodeid
