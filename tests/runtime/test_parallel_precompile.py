"""precompile's parallel compile pass: the compile-only mode of a kernel-cache miss (each worker compiles its
share of every key's configs and launches nothing) and the worker processes' plumbing."""

import importlib
import json
import warnings

import pytest
import torch
import triton.language as tl

import dflash_kernels as dk
from dflash_kernels.runtime import Config, TritonKernel, alloc, settings, tuning

pc = importlib.import_module("dflash_kernels.runtime.precompile")  # the module (the package exports the function)


class _Compiled:
    def _init_handles(self):  # Triton loads the module and builds the launcher here
        pass


class _FakeJit:
    """Stands in for a compiled ``@triton.jit`` function: records what would be compiled, fails on a launch."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled = []

    def warmup(self, *args, grid, num_warps, num_stages):
        self.compiled.append((args[2:4], num_warps, num_stages))  # after x and n: BLOCK, EXTRA
        return _Compiled()

    def __getitem__(self, grid):
        raise AssertionError("a compile worker must not launch a kernel")


def _kernel(name):
    def body(x, n, BLOCK: tl.constexpr, EXTRA: tl.constexpr, MODE: tl.constexpr = 0):
        pass

    configs = [Config(BLOCK=b, EXTRA=e, num_warps=w) for b in (16, 32, 64) for e in (0, 1) for w in (4, 8)]
    k = TritonKernel(_FakeJit(body), name=name, configs=configs)
    k.interpreted = False  # the GPU path, whatever TRITON_INTERPRET says
    return k


@pytest.fixture
def shard_reset():
    yield
    settings.set_compile_shard(None)


@pytest.mark.parametrize("shards", [1, 3, 5])
def test_workers_split_every_candidate_between_them(shards, shard_reset, monkeypatch, tmp_path):
    """Tuning on, nothing stored: over all workers, every candidate of the key is compiled exactly once; no
    worker launches or stores anything."""
    monkeypatch.setenv("DFLASH_KERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DFLASH_KERNELS_TUNE", "1")
    monkeypatch.setattr(tuning.TuningStore, "put", lambda *a, **k: pytest.fail("a compile worker stored a tuning result"))
    x = torch.zeros(8)
    seen = []
    for i in range(shards):
        k = _kernel(f"fake_split_{shards}")
        settings.set_compile_shard((i, shards))
        k((1,), x, 8)
        k((1,), x, 8)  # a second call of the key: the cached no-launch entry
        seen += k.fn.compiled
        (info,) = k.cache_info().values()
        assert info["tuned_from"] == "compile-only" and info["compiles"] == len(k.fn.compiled)
    expected = [((c.meta["BLOCK"], c.meta["EXTRA"]), c.num_warps, c.num_stages) for c in _kernel("x").configs]
    assert sorted(seen) == sorted(expected)


def test_a_stored_config_is_the_only_one_compiled(shard_reset, monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_KERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DFLASH_KERNELS_TUNE", "1")
    x = torch.zeros(8)
    chosen = _kernel("probe").configs[7]
    monkeypatch.setattr(tuning.TuningStore, "lookup", lambda self, dev, name: (
        ({"config": chosen.as_dict()}, "packaged") if name.startswith("fake_stored|") else (None, None)))
    seen = []
    for i in range(4):
        k = _kernel("fake_stored")
        settings.set_compile_shard((i, 4))
        k((1,), x, 8)
        seen += k.fn.compiled
    assert seen == [((chosen.meta["BLOCK"], chosen.meta["EXTRA"]), chosen.num_warps, chosen.num_stages)]


def test_tuning_off_compiles_the_first_config_only(shard_reset, monkeypatch):
    monkeypatch.setenv("DFLASH_KERNELS_TUNE", "0")
    x = torch.zeros(8)
    seen = []
    for i in range(3):
        k = _kernel("fake_untuned")
        settings.set_compile_shard((i, 3))
        k((1,), x, 8)
        seen += k.fn.compiled
    first = _kernel("y").configs[0]
    assert seen == [((first.meta["BLOCK"], first.meta["EXTRA"]), first.num_warps, first.num_stages)]


def test_outputs_are_zeros_in_a_compile_worker(shard_reset, monkeypatch):
    """Nothing launches there, so what the host reads back (counts, sizes) must not be the allocator's leftovers."""
    monkeypatch.setenv("DFLASH_KERNELS_POISON", "1")
    settings.set_compile_shard((0, 2))
    assert torch.equal(alloc.empty(5, dtype=torch.int32, device="cpu"), torch.zeros(5, dtype=torch.int32))
    assert torch.equal(alloc.empty_like(torch.ones(3)), torch.zeros(3))
    settings.set_compile_shard(None)
    assert torch.isnan(alloc.empty(5, dtype=torch.float32, device="cpu")).all()


def test_specs_travel_to_the_workers_as_json():
    shape = {"N": 3, "weight_dtype": torch.float32, "tensors": [{"numel": 5, "copy_dtype": torch.bfloat16}]}
    assert pc.decode(pc.encode(shape)) == shape
    assert pc.decode(pc.encode(torch.float16)) is torch.float16


def test_worker_processes_run_the_specs_and_report_problems(monkeypatch):
    """The plumbing on the CPU (kernels interpreted there, so the workers run them): two processes, a good spec
    and one whose builder raises; the failure comes back named, as a warning, never silently."""
    specs = [("swiglu", {"N": 4, "C": 8}, torch.float32),
             ("rms_norm", {"N": 4, "D": 8, "weight_dtype": torch.float32}, torch.float32),
             ("rms_norm", {"N": 4}, torch.float32)]  # no D: the builder raises KeyError
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rep = pc._parallel_compile(specs, [torch.device("cpu")], True, 2, verbose=False)
    assert rep["workers"] == 2
    # Under the interpreter the CPU's ops run the Triton kernels (each key counted once per worker); without it
    # they run the reference backend and nothing is compiled.
    assert (rep["compiled"] > 0) if settings.interpreting() else (rep["compiled"] == 0), rep
    assert len(rep["errors"]) == 2 and all("rms_norm" in e and "KeyError" in e for e in rep["errors"]), rep
    assert any("parallel compile pass had 2 problems" in str(w.message) for w in caught)


def test_out_of_memory_specs_are_retried_one_worker_at_a_time(tmp_path):
    """A spec that ran out of device memory (torch's error, or cuBLAS failing to allocate) is not a problem yet:
    each worker retries it after its other specs, under a lock and after every worker's first pass, so that the
    retries of the largest shapes do not run out again by all running at once or beside another worker's
    largest shapes."""
    from tests.runtime import oom_builders  # noqa: F401 - registers the builders (the workers import it too)

    log = tmp_path / "retries.txt"
    specs = [("toy_oom_once", {"log": str(log)}, torch.float32), ("toy_cublas_once", {"log": str(log)}, torch.float32),
             ("toy_slow", {"log": str(log)}, torch.float32)]
    rep = pc._parallel_compile(specs, [torch.device("cpu")], False, 2, verbose=False)
    assert rep["errors"] == [], rep
    runs = [line.split() for line in log.read_text().splitlines()]
    slow = [(float(a), float(b)) for _, op, a, b in runs if op == "toy_slow"]
    runs = [r for r in runs if r[1] != "toy_slow"]
    assert len(slow) == 2, slow  # one first-pass run per worker (the second one 1.5 s longer)
    first_pass_end = max(b for _, b in slow)
    assert all(float(a) >= first_pass_end for _, _, a, _ in runs), f"a retry began during a first pass: {runs}, {slow}"
    assert sorted((pid, op) for pid, op, _, _ in runs) == sorted(
        (pid, op) for pid in {r[0] for r in runs} for op in ("toy_cublas_once", "toy_oom_once")), runs
    assert len({pid for pid, _, _, _ in runs}) == 2, runs
    spans = sorted((float(a), float(b), pid) for pid, _, a, b in runs)
    for (a0, b0, p0), (a1, b1, p1) in zip(spans, spans[1:]):
        assert p0 == p1 or a1 >= b0, f"retries of two workers overlapped: {spans}"


def test_retries_wait_for_every_first_pass_but_not_for_a_dead_worker(tmp_path):
    """The first-pass marks are per device and per worker; a worker that never marks (it died) holds the others'
    retries back only until the timeout."""
    from dflash_kernels.runtime.compile_worker import first_pass_done, wait_for_first_passes

    job = str(tmp_path / "job.json")
    first_pass_done(job, 0, 0)
    first_pass_done(job, 1, 1)  # another device's mark does not count
    assert not wait_for_first_passes(job, 0, 2, timeout=0.2)
    first_pass_done(job, 0, 1)
    assert wait_for_first_passes(job, 0, 2, timeout=0.2)


def test_a_real_failure_is_not_retried():
    from dflash_kernels.runtime.compile_worker import out_of_memory

    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert not out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not out_of_memory(KeyError("D"))


def test_default_workers(monkeypatch):
    monkeypatch.delenv("DFLASH_KERNELS_PRECOMPILE_WORKERS", raising=False)
    assert pc.default_workers([torch.device("cpu")]) == 0
    assert 1 <= pc.default_workers([torch.device("cuda", 0)]) <= 16
    monkeypatch.setattr(pc.os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    assert pc.default_workers([torch.device("cuda", 0)]) == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert pc.default_workers([torch.device("cuda", 0)]) == 4  # torchrun: the machine's cores shared
    monkeypatch.setenv("DFLASH_KERNELS_PRECOMPILE_WORKERS", "3")
    assert pc.default_workers([torch.device("cpu")]) == 3
    monkeypatch.setenv("DFLASH_KERNELS_PRECOMPILE_WORKERS", "many")
    with pytest.raises(ValueError, match="DFLASH_KERNELS_PRECOMPILE_WORKERS.*'many'"):
        pc.default_workers([torch.device("cpu")])


def test_precompile_reports_how_each_key_got_its_config():
    rep = dk.precompile([("swiglu", {"N": 5, "C": 24}, torch.float32)], devices=["cpu"], verbose=False, workers=0)
    (item,) = rep["items"]
    assert rep["parallel"] is None
    assert item["compiled"] == item["new_keys"] and item["tuned"] + item["stored"] <= item["compiled"]


class _Recorded(_FakeJit):
    def warmup(self, *args, grid, num_warps, num_stages):
        self.compiled.append((tuple(args[:2]), args[2:], num_warps, num_stages))
        return _Compiled()


def test_a_launch_signature_is_recorded_and_compiled_back_from_it(shard_reset, monkeypatch, tmp_path):
    """The signature a compiled launch leaves in the store gives Triton's warmup the same argument types and
    alignment (stand-in tensors), ints and constexprs; the workers split its candidates between them."""
    from triton.runtime.jit import MockTensor

    monkeypatch.setenv("DFLASH_KERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DFLASH_KERNELS_TUNE", "1")
    monkeypatch.setenv("DFLASH_KERNELS_PACKAGED_TUNING", "0")
    k = _kernel("fake_recorded")
    x = torch.zeros(9, dtype=torch.bfloat16)
    args, constexprs = (x[1:], 17), {"MODE": 1}
    key = ((4,), tuple(constexprs.items()), k._spec(*args), -1)
    k._record_signature(key, args, constexprs, -1)
    name = tuning.SIGNATURE_PREFIX + k._persist_name(key)
    store = tuning.store()
    assert store.entries(-1, tuning.SIGNATURE_PREFIX) == {name: {
        "args": [["T", "bfloat16", False], ["I", 17]], "constexprs": {"MODE": 1}}}
    seen = []
    for i in range(3):
        fake = _Recorded(k.fn.fn)
        monkeypatch.setattr(k, "fn", fake)
        assert k.compile_signature(k._persist_name(key), store.get(-1, name), -1, (i, 3)) == len(fake.compiled)
        seen += fake.compiled
    assert len(seen) == len(k.configs)
    for (tensor, n), tail, _, _ in seen:
        assert isinstance(tensor, MockTensor) and tensor.dtype == torch.bfloat16 and tensor.data_ptr() % 16 == 8
        assert n == 17 and tail[2] == 1  # MODE from the recorded constexprs, BLOCK and EXTRA from each config
    assert sorted((t, w) for _, t, w, _ in seen) == sorted(
        ((c.meta["BLOCK"], c.meta["EXTRA"], 1), c.num_warps) for c in k.configs)


def test_signatures_of_other_argument_types_are_not_recorded():
    from dflash_kernels.runtime.kernel import describe_launch

    assert describe_launch((torch.zeros(2), None, True, 3, 0.5), {"A": 2, "B": "x"}) == {
        "args": [["T", "float32", True], ["N"], ["B", True], ["I", 3], ["F", 0.5]], "constexprs": {"A": 2, "B": "x"}}
    assert describe_launch((torch.zeros(2), object()), {}) is None
    assert describe_launch((torch.zeros(2),), {"A": torch.float32}) is None


def test_gluon_descriptor_signatures_round_trip_through_json():
    """A Gluon TMA descriptor argument is recorded by what Triton specializes it on (dtype, box, shared layout,
    padding), and its stand-in, rebuilt from the JSON, specializes exactly as the real descriptor."""
    from triton.backends.compiler import BaseBackend
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from dflash_kernels.runtime.kernel import _mock_arg, _specialize, describe_launch

    cases = ((torch.bfloat16, gl.bfloat16, [1, 64, 128]), (torch.float16, gl.float16, [1, 128, 64]))
    for dtype, gl_dtype, block in cases:
        x = torch.zeros(2, 300, 4 * block[2], dtype=dtype)
        desc = TensorDescriptor(x, list(x.shape), list(x.stride()), block,
                                gl.NVMMASharedLayout.get_default_for(block, gl_dtype))
        sig = json.loads(json.dumps(describe_launch((desc, x, 7), {"BN": 128})))
        assert sig["args"][0][:3] == ["D", str(dtype).replace("torch.", ""), block]
        real, mock = (_specialize(BaseBackend, d, False, True, True) for d in (desc, _mock_arg(sig["args"][0])))
        assert real == mock and real[0].startswith("tensordesc<")


def test_config_maxnreg_is_a_launch_option_only_where_set():
    from dflash_kernels.runtime import Config

    plain, gluon = Config(num_warps=8, BN=64), Config(num_warps=4, num_stages=1, maxnreg=168)
    assert plain.launch_options() == {"num_warps": 8, "num_stages": 2} and "maxnreg" not in plain.as_dict()
    assert gluon.launch_options() == {"num_warps": 4, "num_stages": 1, "maxnreg": 168}
    assert Config.from_dict(gluon.as_dict()).as_dict() == gluon.as_dict()
    assert repr(plain) == "Config(BN=64, num_warps=8, num_stages=2)"  # unchanged: persisted keys hash it


def test_precompile_recorded_does_nothing_on_the_cpu():
    rep = dk.precompile_recorded(verbose=False)
    assert rep["compiled"] == 0 and rep["workers"] == 0 and not rep["errors"]


def test_ship_keeps_signatures_of_current_kernels_only(tmp_path):
    cache = tmp_path / "tuning-GPU-tritonX.json"
    good = tuning.SIGNATURE_PREFIX + "kern|abc|()|()|()"
    stale = tuning.SIGNATURE_PREFIX + "kern|old|()|()|()"
    cache.write_text(json.dumps({good: {"args": []}, stale: {"args": []}}))
    path, kept, dropped = tuning.ship(str(cache), kernels={"kern": "abc"}, packaged_dir=str(tmp_path / "pkg"))
    assert (kept, dropped) == (1, 1) and set(json.loads(open(path).read())) == {good}


def test_ship_names_the_run_in_the_file(tmp_path):
    cache = tmp_path / "tuning-GPU-tritonX.json"
    cache.write_text(json.dumps({"kern|abc|()|()|()": {"config": {}, "ms": 1.0}}))
    path, kept, _ = tuning.ship(str(cache), kernels={"kern": "abc"}, packaged_dir=str(tmp_path / "pkg"),
                                run="tok_s --preset real on GPU")
    table = json.loads(open(path).read())
    (run,) = [v for k, v in table.items() if k.startswith(tuning.RUN_PREFIX)]
    assert run["run"] == "tok_s --preset real on GPU" and run["entries"] == kept == 1


def test_a_background_pass_is_waited_for_and_not_repeated(monkeypatch):
    """precompile_recorded(background=True) returns at once; a second call for the same GPU model waits for it and
    compiles only what it left (here: nothing), so a trainer can start the pass before loading its target."""
    calls, entered = [], __import__("threading").Event()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(settings, "interpreting", lambda: False)
    monkeypatch.setattr(pc, "gpu_model", lambda index: "FAKE_GPU")
    monkeypatch.setattr(tuning.TuningStore, "entries", lambda self, dev, prefix: {
        f"{prefix}{k.name}|{k._source_hash}|()|()|()": {"args": [], "constexprs": {}} for k in pc.all_kernels()[:3]})

    def fake_run(job, workers, verbose, mode=None):
        entered.set()
        calls.append(sorted(job["signatures"]))
        return len(job["signatures"]), []
    monkeypatch.setattr(pc, "_run_workers", fake_run)
    monkeypatch.setattr(pc, "_done", set())
    monkeypatch.setattr(pc.kernel_bundle, "ensure_shipped", lambda dev: set())
    monkeypatch.setattr(tuning.TuningStore, "get", lambda self, dev, name: None)
    pending = pc.precompile_recorded(device="cuda:0", workers=2, verbose=False, background=True)
    assert isinstance(pending, pc.PendingPrecompile)
    assert entered.wait(10)  # the background pass holds the GPU model's lock (or has finished)
    later = pc.precompile_recorded(device="cuda:0", workers=2, verbose=False)
    first = pending.wait()
    assert len(calls) == 1 and first["compiled"] == 3 and first["workers"] == 2
    assert later["compiled"] == 0 and later["done_before"] == 3 and later["workers"] == 0
