"""The tuning compile pool (runtime/compile_pool.py): its protocol with the worker processes, how it splits a key's
candidates between them, and what happens when it fails. Fake workers stand in for the compiling (a CPU cannot
compile for a GPU through Triton's JIT); the real worker's request loop is run once for its protocol."""

import json
import subprocess
import sys

import pytest

from dflash_kernels.runtime import Config, compile_pool, settings

FAKE = r'''
import json, sys
PREFIX = "DFLASH_KERNELS_POOL "
print("some library's start-up line", flush=True)
print(PREFIX + json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    if MODE == "die":
        sys.exit(3)
    with open(LOG, "a") as f:
        f.write(json.dumps(req) + "\n")
    print(PREFIX + json.dumps({"compiled": len(req["configs"]), "errors": []}), flush=True)
'''


class _Kernel:
    name = "fake_pool_kernel"
    configs = [Config(BLOCK=b, num_warps=w) for b in (16, 32, 64) for w in (4, 8)]


@pytest.fixture
def pool(monkeypatch, tmp_path):
    def use(mode="ok", n=3):
        log = tmp_path / "requests.jsonl"
        code = f"MODE = {mode!r}\nLOG = {str(log)!r}\n" + FAKE
        monkeypatch.setattr(compile_pool, "WORKER_CMD", [sys.executable, "-c", code])
        monkeypatch.setenv("DFLASH_KERNELS_TUNE_WORKERS", str(n))
        monkeypatch.setattr(settings, "interpreting", lambda: False)
        monkeypatch.setattr(compile_pool, "_broken", None)
        return log
    yield use
    compile_pool.shutdown()


def test_a_keys_candidates_are_split_between_the_workers(pool):
    log = pool(n=4)
    signature = {"args": [["T", "bfloat16", True], ["I", 7]], "constexprs": {"MODE": 1}}
    assert compile_pool.compile_candidates(_Kernel, signature, 0) == len(_Kernel.configs)
    requests = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(requests) == 4 and all(r["kernel"] == "fake_pool_kernel" and r["signature"] == signature
                                      and r["device"] == 0 for r in requests)
    sent = sorted(json.dumps(c, sort_keys=True) for r in requests for c in r["configs"])
    assert sent == sorted(json.dumps(c.as_dict(), sort_keys=True) for c in _Kernel.configs)
    # the pool stays up for the next key: no new start-up
    assert compile_pool.compile_candidates(_Kernel, signature, 0) == len(_Kernel.configs)
    assert len(log.read_text().splitlines()) == 8


def test_a_failing_pool_warns_once_and_is_not_used_again(pool):
    pool(mode="die", n=2)
    with pytest.warns(RuntimeWarning, match="tuning compile pool failed"):
        assert compile_pool.compile_candidates(_Kernel, {"args": [], "constexprs": {}}, 0) == 0
    assert compile_pool._broken is not None and compile_pool._pool is None
    assert compile_pool.compile_candidates(_Kernel, {"args": [], "constexprs": {}}, 0) == 0  # no second warning


@pytest.mark.parametrize("env", ["0", "1"])
def test_the_pool_is_off_with_fewer_than_two_workers(pool, monkeypatch, env):
    log = pool()
    monkeypatch.setenv("DFLASH_KERNELS_TUNE_WORKERS", env)
    assert compile_pool.compile_candidates(_Kernel, {"args": [], "constexprs": {}}, 0) == 0
    assert not log.exists()


def test_the_pool_is_off_in_the_interpreter_and_in_compile_workers(pool, monkeypatch):
    log = pool()
    monkeypatch.setattr(settings, "interpreting", lambda: True)
    assert compile_pool.compile_candidates(_Kernel, {"args": [], "constexprs": {}}, 0) == 0
    monkeypatch.setattr(settings, "interpreting", lambda: False)
    settings.set_compile_shard((0, 2))
    try:
        assert compile_pool.compile_candidates(_Kernel, {"args": [], "constexprs": {}}, 0) == 0
    finally:
        settings.set_compile_shard(None)
    assert not log.exists()


@pytest.mark.parametrize("value,message", [("x", "whole number"), ("-2", ">= 0")])
def test_bad_worker_counts_are_named(monkeypatch, value, message):
    monkeypatch.setenv("DFLASH_KERNELS_TUNE_WORKERS", value)
    with pytest.raises(ValueError, match=f"DFLASH_KERNELS_TUNE_WORKERS.*{message}"):
        compile_pool.workers()


def test_the_real_worker_answers_every_request():
    """``compile_worker --serve`` says it is ready, then answers each request with one reply line, also for
    requests it cannot compile (an unknown kernel; on a CPU, any kernel)."""
    proc = subprocess.Popen([sys.executable, "-m", "dflash_kernels.runtime.compile_worker", "--serve"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    requests = [{"kernel": "no_such_kernel", "signature": {"args": [], "constexprs": {}},
                 "configs": [{"num_warps": 4}], "device": 0},
                {"kernel": "swiglu_fwd", "signature": {"args": [["T", "float32", True]], "constexprs": {}},
                 "configs": [{"num_warps": 4, "num_stages": 2}], "device": 0}]
    out, _ = proc.communicate("".join(json.dumps(r) + "\n" for r in requests), timeout=120)
    replies = [json.loads(x[len(compile_pool.REPLY):]) for x in out.splitlines() if x.startswith(compile_pool.REPLY)]
    assert replies[0] == {"ready": True} and len(replies) == 3
    assert replies[1] == {"compiled": 0, "errors": []}
    assert replies[2]["compiled"] == 0 and len(replies[2]["errors"]) == 1  # no GPU here: reported, not fatal
