"""The runtime: per-key compile cache under threads, strict mode, tuning persistence, precompile, backends."""

import importlib
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import pytest
import torch

import dflash_kernels as dk
from dflash_kernels.runtime import backends, tuning
from dflash_kernels.runtime.kernel import all_kernels
from tests.helpers import device, slow_param

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _conv_keys():
    return {k: v for k, v in dk.cache_info().items() if k[0].startswith("causal_conv1d")}


def _workload(i):
    """Four (dtype, width) combinations, so threads i and i + 4 share a key; each thread has its own
    data and length (33..82: buckets 64 and 128)."""
    dtype = [torch.float32, torch.bfloat16][i % 2]
    W = [3, 4][(i // 2) % 2]
    T = 33 + 7 * i
    g = torch.Generator().manual_seed(i)
    x = torch.randn(2, 6, T, generator=g).to(device(), dtype)
    w = torch.randn(6, W, generator=g).to(device(), dtype)
    return x, w


def _run(i):
    x, w = _workload(i)
    x.requires_grad_()
    y = dk.causal_conv1d(x, w, activation="silu")
    (gx,) = torch.autograd.grad(y.float().square().sum(), x)
    return y.detach(), gx


@pytest.fixture(autouse=True)
def _conv_on_triton():
    """These tests count the runtime's Triton compiles through the conv op; on a GPU with the CUDA
    extension built, "auto" may choose the extension, which compiles nothing."""
    if torch.cuda.is_available():
        dk.set_backend("conv1d", "triton")
    yield
    dk.set_backend("conv1d", "auto")


def test_threads_cold_cache_compile_each_key_once():
    n_threads = 8
    dk.reset_cache()
    expected = [_run(i) for i in range(n_threads)]  # single-threaded results
    single_keys = set(_conv_keys())
    dk.reset_cache()
    assert not _conv_keys()

    barrier = threading.Barrier(n_threads)
    results, errors = [None] * n_threads, []

    def worker(i):
        try:
            barrier.wait()
            results[i] = _run(i)
        except BaseException as e:  # noqa: BLE001 - collected and reported below
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    assert not errors, errors
    for i, ((y, gx), (y_ref, gx_ref)) in enumerate(zip(results, expected)):
        assert torch.equal(y, y_ref), f"thread {i}: output differs from the single-threaded run"
        assert torch.equal(gx, gx_ref), f"thread {i}: gradient differs from the single-threaded run"
    info = _conv_keys()
    assert set(info) == single_keys, "threads compiled a different set of keys than one thread"
    assert all(v["compiles"] == 1 for v in info.values()), {k: v["compiles"] for k, v in info.items()}
    # Threads 0-4 fall in bucket 64 and 5-7 in bucket 128 (T = 33 + 7 i): 4 + 3 keys per kernel,
    # and threads 0 and 4 share every key, so the cache saw hits.
    assert len(info) == 2 * 7, sorted(info, key=repr)
    assert sum(v["hits"] for v in info.values()) > 0


def test_variable_length_reuses_one_kernel_per_bucket():
    """Lengths of one bucket share a kernel, apart from Triton's alignment class of T (a multiple of
    16 or not), which the conv kernels keep so their accesses vectorize: at most two per bucket."""
    dk.reset_cache()
    w = torch.randn(4, 4, device=device())
    for T in (33, 40, 50):  # one bucket (next power of two: 64), none a multiple of 16
        dk.causal_conv1d(torch.randn(1, 4, T, device=device()), w)
    assert len([k for k in _conv_keys() if k[0] == "causal_conv1d_fwd"]) == 1
    for T in (48, 64):  # the same bucket, multiples of 16: one more kernel for both
        dk.causal_conv1d(torch.randn(1, 4, T, device=device()), w)
    assert len([k for k in _conv_keys() if k[0] == "causal_conv1d_fwd"]) == 2


def test_strict_mode_raises_on_miss_and_allows_hits():
    dk.reset_cache()
    x, w = torch.randn(1, 4, 20, device=device()), torch.randn(4, 4, device=device())
    dk.causal_conv1d(x, w)  # compiled outside strict mode
    with dk.strict():
        dk.causal_conv1d(x, w)  # a hit is fine
        with pytest.raises(dk.KernelCacheMiss, match="causal_conv1d_fwd"):
            dk.causal_conv1d(x, w, activation="silu")  # a new constexpr: a miss
    dk.causal_conv1d(x, w, activation="silu")  # outside again: compiles


def test_strict_mode_env_var():
    code = ("import torch, dflash_kernels as dk\n"
            "dev = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
            "try:\n    dk.causal_conv1d(torch.randn(1, 4, 8, device=dev), torch.randn(4, 4, device=dev))\n"
            "except dk.KernelCacheMiss as e:\n    print('MISS', e)\n")
    # The Triton path (on a GPU with the CUDA extension built, "auto" may pick the extension, which
    # compiles nothing and so cannot miss).
    backend = "triton" if torch.cuda.is_available() else os.environ.get("DFLASH_KERNELS_BACKEND", "")
    env = {**os.environ, "DFLASH_KERNELS_STRICT": "1", "DFLASH_KERNELS_BACKEND": f"conv1d={backend}" if backend else ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert "MISS" in out.stdout and "causal_conv1d_fwd" in out.stdout, out.stdout + out.stderr


def test_precompile_then_strict():
    dk.reset_cache()
    report = dk.precompile([("conv1d", dict(B=1, D=8, T=48, W=4), torch.float32)], devices=[device()],
                           verbose=False)
    assert report["keys"], report
    assert {k[0] for k in report["keys"]} == {"causal_conv1d_fwd", "causal_conv1d_bwd"}
    assert report["items"][0]["new_keys"] == len(report["keys"])
    with dk.strict():
        x = torch.randn(1, 8, 40, device=device(), requires_grad=True)  # same bucket as T=48
        w = torch.randn(8, 4, device=device(), requires_grad=True)
        b = torch.randn(8, device=device(), requires_grad=True)
        dk.causal_conv1d(x, w, b, "silu").sum().backward()
    with pytest.raises(ValueError, match="specs: unknown op 'nope'"):
        dk.precompile([("nope", {}, torch.float32)], devices=[device()])


def test_precompile_of_the_rms_norm_functions_then_strict():
    """A precompile of each public function of the RMSNorm op (``rms_norm``, ``rms_norm_gated``,
    ``fused_add_rms_norm``) compiles what that function runs, forward and backward (the fused add in the decoder
    layer's form: both outputs read on), so that none of them misses in strict mode."""
    from dflash_kernels.ops.rms_norm import fused_add_rms_norm, rms_norm, rms_norm_gated

    dk.reset_cache()  # keys compiled by earlier tests must not stand in for the precompile's
    specs = [(name, dict(N=20, D=40), torch.float32) for name in ("rms_norm", "rms_norm_gated", "fused_add_rms_norm")]
    report = dk.precompile(specs, devices=[device()], verbose=False)
    assert all(item["new_keys"] for item in report["items"]), report["items"]

    def leaves(n):
        return [torch.randn(20, 40, device=device(), requires_grad=True) for _ in range(n)]

    w = torch.randn(40, device=device(), requires_grad=True)
    with dk.strict():
        (x,) = leaves(1)
        torch.autograd.grad(rms_norm(x, w).sum(), (x, w))
        x, g = leaves(2)
        torch.autograd.grad(rms_norm_gated(x, g, w).sum(), (x, g, w))
        x, r = leaves(2)
        y, h = fused_add_rms_norm(x, r, w)
        torch.autograd.grad((y.sum(), h.sum()), (x, r, w))


def test_register_precompile_names_and_conflicts(monkeypatch):
    pc = importlib.import_module("dflash_kernels.runtime.precompile")  # the module (the package exports the function)
    monkeypatch.setattr(pc, "_builders", {})
    ran = []

    @dk.runtime.register_precompile("toy", "toy_gated")
    def build(shape, dtype, device, backward):
        ran.append(shape["N"])

    dk.precompile([("toy", dict(N=1), torch.float32), ("toy_gated", dict(N=2), torch.float32)],
                  devices=[torch.device("cpu")], verbose=False)
    assert ran == [1, 2]
    with pytest.raises(ValueError, match=r"op: 'toy_gated' already has a precompile builder \(.*build\)"):
        dk.runtime.register_precompile("toy_gated")(lambda shape, dtype, device, backward: None)
    assert pc._builders["toy_gated"] is build


def _put_keys(directory, i, n, go):
    """A process of the test below: ``n`` entries of its own into the store of ``directory``, once ``go`` is set
    (so that the processes write at the same time, not one after the other's start-up)."""
    store = tuning.TuningStore(directory)
    go.wait()
    store.get(-1, "none")  # a lookup first, as a config choice does: a damaged file is seen (and moved) here
    for j in range(n):
        store.put(-1, f"k{i}-{j}", {"config": {"BT": j}, "ms": 1.0})


@pytest.mark.parametrize("start", ["absent", slow_param("damaged")])
def test_processes_writing_one_tuning_file_lose_no_entry(tmp_path, start):
    """Four processes (spawned, not forked) put 20 entries each into one file at once: all 80 are there at the
    end, a reader never sees the file invalid, a new store reads them, no temporary file is left. Starting from
    a damaged file, exactly one process moves it aside (one ``.corrupt-1``, holding the damaged bytes)."""
    import multiprocessing

    path = pathlib.Path(tuning.TuningStore(str(tmp_path)).path(-1))
    damaged = b'{"k|h|1": {"config": '
    if start == "damaged":
        path.write_bytes(damaged)
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    procs = [ctx.Process(target=_put_keys, args=(str(tmp_path), i, 20, go)) for i in range(4)]
    for p in procs:
        p.start()
    go.set()
    while any(p.is_alive() for p in procs):
        if start == "absent" and path.exists():
            assert isinstance(json.loads(path.read_bytes()), dict), "a reader saw an invalid tuning file"
        time.sleep(0.002)
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0] * 4
    data = json.loads(path.read_text())
    assert set(data) == {f"k{i}-{j}" for i in range(4) for j in range(20)}
    assert tuning.TuningStore(str(tmp_path)).get(-1, "k3-19") == {"config": {"BT": 19}, "ms": 1.0}
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")], "temporary files left behind"
    aside = sorted(f for f in os.listdir(tmp_path) if ".corrupt-" in f)
    if start == "damaged":
        assert aside == [path.name + ".corrupt-1"], aside
        assert (tmp_path / aside[0]).read_bytes() == damaged
    else:
        assert not aside


DAMAGED = {"invalid JSON": b'{"k|h|1": {"config": {"BT": 1}, "ms"', "a list": b"[1, 2]",
           "an entry not an object": b'{"k|h|1": 3}', "empty": b"", "not UTF-8": b'{"\xff": {}}'}


@pytest.mark.parametrize("content", list(DAMAGED.values()), ids=list(DAMAGED))
def test_a_damaged_tuning_file_is_moved_aside_never_overwritten(tmp_path, content):
    store = tuning.TuningStore(str(tmp_path))
    path = pathlib.Path(store.path(-1))
    aside = [pathlib.Path(f"{path}.corrupt-{n}") for n in (1, 2, 3)]
    path.write_bytes(content)
    aside[0].write_bytes(b"an older damaged file")  # taken: the next free number is 2
    with pytest.warns(dk.runtime.TuningCacheWarning) as caught:
        assert store.get(-1, "k|h|1") is None, "a damaged file's entries are not read"
        store.put(-1, "k|h|2", {"config": {"BT": 2}, "ms": 1.0})
    messages = [str(w.message) for w in caught if issubclass(w.category, dk.runtime.TuningCacheWarning)]
    assert len(messages) == 1 and str(path) in messages[0] and str(aside[1]) in messages[0], messages
    assert aside[1].read_bytes() == content, "the damaged file is kept as it was"
    assert aside[0].read_bytes() == b"an older damaged file"
    assert json.loads(path.read_text()) == {"k|h|2": {"config": {"BT": 2}, "ms": 1.0}}, "the store started empty"
    assert tuning.TuningStore(str(tmp_path)).get(-1, "k|h|2") == {"config": {"BT": 2}, "ms": 1.0}

    # Damaged by someone else after this store read it: the next write moves it aside too, never over it.
    path.write_bytes(content)
    with pytest.warns(dk.runtime.TuningCacheWarning, match="corrupt-3"):
        store.put(-1, "k|h|3", {"config": {"BT": 3}, "ms": 1.0})
    assert aside[2].read_bytes() == content
    assert set(json.loads(path.read_text())) == {"k|h|3"}


@pytest.fixture
def read_only_directory(tmp_path):
    """An existing folder nothing can be written into. Root ignores the permission bits, so as root the folder
    is also made immutable (``chattr +i``); where neither holds, the test is skipped."""
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    immutable = False

    def writable():
        try:
            (folder / "probe").touch()
        except OSError:
            return False
        (folder / "probe").unlink()
        return True

    if writable():
        immutable = subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
        if not immutable or writable():
            folder.chmod(0o755)
            pytest.skip("cannot make a read-only folder here (root, without chattr)")
    yield folder
    if immutable:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    folder.chmod(0o755)


@pytest.fixture(params=["read_only", "under_a_file"])
def unwritable_cache(request, tmp_path):
    """A cache folder that exists read-only, or a path that cannot be created (under a regular file)."""
    if request.param == "read_only":
        return request.getfixturevalue("read_only_directory")
    (tmp_path / "a_file").write_text("")
    return tmp_path / "a_file" / "cache"


def test_an_unwritable_cache_folder_keeps_results_in_memory_with_one_warning(unwritable_cache, monkeypatch):
    """The config choice of a kernel (as on a GPU with tuning on; the timing replaced) and a timed implementation
    choice both go on when nothing can be written: their results are kept in memory for the process (found
    again without timing), and one warning names the folder however many writes fail."""
    import warnings

    from dflash_kernels.runtime.kernel import _Entry

    monkeypatch.setenv("DFLASH_KERNELS_CACHE_DIR", str(unwritable_cache))
    monkeypatch.setenv("DFLASH_KERNELS_TUNE", "1")
    kernel = next(k for k in all_kernels() if len(k.configs) > 1)
    timed = []

    def fake_timing(grid, args, constexprs, dev):
        timed.append(args)
        return kernel.configs[1], {repr(c): 1.0 + i for i, c in enumerate(kernel.configs)}

    monkeypatch.setattr(kernel, "_time_configs", fake_timing)
    keys = [((64,), (), ("fast", i), -1) for i in range(3)]
    choice = dk.runtime.Choice("test_unwritable", default="triton", version=lambda: "v1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, key in enumerate(keys):
            entry = _Entry()
            assert kernel._choose_config(key, (1,), (i,), {}, -1, entry) is kernel.configs[1]
            assert entry.tuned_from == "timed"
        assert choice.choose(("fwd", 1), torch.device("cpu"), _candidates(),
                             timer=_FakeTimer({"triton": 2.0, "cuda": 1.0})) == "cuda"
        entry = _Entry()  # a key of the process again (a reset cache): found in memory, not timed again
        again = kernel._choose_config(keys[0], (1,), ("again",), {}, -1, entry)
        assert again.as_dict() == kernel.configs[1].as_dict()
        assert entry.tuned_from == "disk" and timed == [(0,), (1,), (2,)]
        choice.reset()
        assert choice.choose(("fwd", 1), torch.device("cpu"), _candidates(), timer=_no_timing) == "cuda"
    ours = [w for w in caught if issubclass(w.category, dk.runtime.TuningCacheWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert str(unwritable_cache) in str(ours[0].message)
    assert not os.path.exists(unwritable_cache) or not os.listdir(unwritable_cache)


@pytest.mark.gpu
def test_gpu_op_runs_with_an_uncreatable_cache_folder(tmp_path, monkeypatch):
    """Tuning on, the cache folder under a regular file: the op runs, timed once, its result kept in memory."""
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("DFLASH_KERNELS_CACHE_DIR", str(tmp_path / "a_file" / "cache"))
    monkeypatch.setenv("DFLASH_KERNELS_TUNE", "1")
    monkeypatch.setenv("DFLASH_KERNELS_PACKAGED_TUNING", "0")
    x, w = torch.randn(2, 384, 777, device="cuda"), torch.randn(384, 4, device="cuda")
    dk.reset_cache()
    with pytest.warns(dk.runtime.TuningCacheWarning, match="cannot write tuning results"):
        y = dk.causal_conv1d(x, w)
    assert {v["tuned_from"] for v in _conv_keys().values()} == {"timed"}
    dk.reset_cache()
    assert torch.equal(dk.causal_conv1d(x, w), y)
    assert {v["tuned_from"] for v in _conv_keys().values()} == {"disk"}, "kept in memory, not timed again"
    dk.reset_cache()


def test_backend_selection_and_errors(monkeypatch):
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="name: unknown backend 'fast'"):
        dk.set_backend("conv1d", "fast")
    with pytest.raises(ValueError, match="op: unknown op 'conv2d'"):
        dk.set_backend("conv2d", "triton")
    try:
        if torch.cuda.is_available() and not dk.runtime.interpreting():
            dk.set_backend("conv1d", "triton")  # runs here, but not on CPU tensors: refused at the call
            with pytest.raises(dk.BackendUnavailable, match="'triton' needs CUDA tensors"):
                dk.causal_conv1d(torch.randn(1, 4, 8), torch.randn(4, 4))
        else:
            with pytest.raises(dk.BackendUnavailable, match="'triton'"):
                dk.set_backend("conv1d", "triton")
        dk.set_backend("conv1d", "reference")
        assert backends.resolve("conv1d", cpu) == "reference"
        y = dk.causal_conv1d(torch.randn(1, 4, 8), torch.randn(4, 4))
        assert y.shape == (1, 4, 8)
    finally:
        dk.set_backend("conv1d", "auto")
    monkeypatch.setenv("DFLASH_KERNELS_BACKEND", "conv1d=reference")
    assert backends.resolve("conv1d", cpu) == "reference"
    monkeypatch.setenv("DFLASH_KERNELS_BACKEND", "conv1d=causal_conv1d")
    if not backends._peer_available("causal_conv1d"):
        with pytest.raises(dk.BackendUnavailable, match=r"pip install 'dflash_kernels\[peers\]'"):
            backends.resolve("conv1d", cpu)
    monkeypatch.delenv("DFLASH_KERNELS_BACKEND")
    report = dk.backends()
    assert report["conv1d"]["configured"] == "auto"
    assert "reference" in report["conv1d"]["available"]


def test_bucket_is_the_capped_next_power_of_two():
    import triton
    for n in list(range(-2, 70)) + [1000, 4097, (1 << 16) + 1]:
        assert dk.runtime.bucket(n) == triton.next_power_of_2(max(n, 1)), n
        for cap in (64, 1 << 16):
            assert dk.runtime.bucket(n, cap) == triton.next_power_of_2(min(max(n, 1), cap)), (n, cap)


def test_cache_info_fields_and_reset():
    dk.reset_cache()
    x, w = torch.randn(1, 4, 20, device=device()), torch.randn(4, 4, device=device())
    for _ in range(3):
        dk.causal_conv1d(x, w)
    (key, entry), = [(k, v) for k, v in _conv_keys().items() if k[0] == "causal_conv1d_fwd"]
    assert entry["compiles"] == 1 and entry["hits"] == 2
    assert {"compile_s", "tune_s", "config", "tuned_from"} <= set(entry)
    dk.reset_cache()
    assert not _conv_keys()
    assert any(k.name == "causal_conv1d_fwd" for k in all_kernels())


def test_packaged_tuning_is_read_where_the_cache_has_no_entry(tmp_path, monkeypatch):
    cache, shipped = tmp_path / "cache", tmp_path / "shipped"
    shipped.mkdir()
    store = tuning.TuningStore(str(cache), packaged_dir=str(shipped))
    name = os.path.basename(store.path(-1))
    with open(shipped / name, "w") as f:
        json.dump({"k|h|1": {"config": {"BT": 1}, "ms": 2.0}, "k|h|2": {"config": {"BT": 2}, "ms": 2.0}}, f)
    monkeypatch.setenv("DFLASH_KERNELS_PACKAGED_TUNING", "1")
    assert store.lookup(-1, "k|h|1") == ({"config": {"BT": 1}, "ms": 2.0}, "packaged")
    assert store.get(-1, "k|h|3") is None and store.lookup(-1, "k|h|3") == (None, None)
    store.put(-1, "k|h|2", {"config": {"BT": 8}, "ms": 1.0})  # timed here: the cache's own entry wins
    assert store.lookup(-1, "k|h|2") == ({"config": {"BT": 8}, "ms": 1.0}, "disk")
    assert json.load(open(shipped / name)) == {"k|h|1": {"config": {"BT": 1}, "ms": 2.0},
                                               "k|h|2": {"config": {"BT": 2}, "ms": 2.0}}, "the package is read-only"
    assert set(json.load(open(store.path(-1)))) == {"k|h|2"}, "a packaged entry is not copied into the cache"
    monkeypatch.setenv("DFLASH_KERNELS_PACKAGED_TUNING", "0")
    assert store.get(-1, "k|h|1") is None and store.get(-1, "k|h|2") == {"config": {"BT": 8}, "ms": 1.0}


def test_ship_keeps_the_entries_of_the_current_kernels(tmp_path):
    cache_file = tmp_path / "tuning-GPU_X-triton9.json"
    entries = {"fwd|aaaa|(64,)": {"config": {"BT": 64}, "ms": 1.0},  # the current source of fwd
               "fwd|0000|(64,)": {"config": {"BT": 16}, "ms": 1.0},  # an older source of fwd: left out
               "impl_choice|v2|('fwd', 1)": {"impl": "triton", "ms": {}}}  # not a Triton kernel: kept
    cache_file.write_text(json.dumps(entries))
    shipped = tmp_path / "tuned"
    path, kept, dropped = tuning.ship(str(cache_file), kernels={"fwd": "aaaa"}, packaged_dir=str(shipped))
    assert (kept, dropped) == (2, 1) and os.path.basename(path) == cache_file.name
    assert set(json.load(open(path))) == {"fwd|aaaa|(64,)", "impl_choice|v2|('fwd', 1)"}
    cache_file.write_text(json.dumps({"fwd|aaaa|(128,)": {"config": {"BT": 32}, "ms": 1.0}}))
    tuning.ship(str(cache_file), kernels={"fwd": "aaaa"}, packaged_dir=str(shipped))  # merges
    assert len(json.load(open(path))) == 3
    # fwd edited: its new entry merged, the package's entries of the old source removed
    cache_file.write_text(json.dumps({"fwd|bbbb|(64,)": {"config": {"BT": 16}, "ms": 1.0}}))
    tuning.ship(str(cache_file), kernels={"fwd": "bbbb"}, packaged_dir=str(shipped))
    assert set(json.load(open(path))) == {"fwd|bbbb|(64,)", "impl_choice|v2|('fwd', 1)"}


def _unfindable_entries(table: dict, hashes: dict) -> list:
    """``(entry, reason)`` for each entry of a tuning file that the runtime can never find or use: a kernel's
    entry must be the key ``TritonKernel._persist_name`` builds at lookup, with the source hash of the kernel
    as it is now compiled (``hashes``: ``{name: hash}``), constexprs the launcher passes (none of them tuned),
    and a config among the kernel's candidates; an implementation choice's entry must name a ``Choice``."""
    from dflash_kernels.runtime import choice

    kernels = {k.name: k for k in all_kernels()}
    choices = {c.name for c in list(choice._registry)}
    found = []
    for entry, value in table.items():
        if entry.startswith(tuning.RUN_PREFIX):  # the record of a run that filled the file
            if not isinstance(value.get("run"), str) or not value["run"]:
                found.append((entry, f"a run record without its command: {value!r}"))
            continue
        signature = entry.startswith(tuning.SIGNATURE_PREFIX)  # a recorded launch signature (precompile_recorded)
        name, _, rest = entry.removeprefix(tuning.SIGNATURE_PREFIX).partition("|")
        if name in choices and not signature:  # <name>|<version>|<key>: the CUDA extension's version is known where it is built
            if not isinstance(value.get("impl"), str):
                found.append((entry, f"no implementation named: {value!r}"))
            continue
        kernel = kernels.get(name)
        if kernel is None:
            found.append((entry, "no kernel or implementation choice of this name"))
            continue
        source, _, key = rest.partition("|")
        if source != hashes.get(name):
            found.append((entry, f"timed on kernel source {source}; the kernel's is now {hashes.get(name)}"))
            continue
        try:
            bucket, constexprs, spec = (eval(part, {"__builtins__": {}, "torch": torch}) for part in key.split("|"))
        except Exception as e:  # noqa: BLE001 - any unreadable key is a finding
            found.append((entry, f"not a key of the form bucket|constexprs|spec: {e!r}"))
            continue
        rebuilt = kernel._persist_name((bucket, constexprs, spec, 0)).replace(
            f"|{kernel._source_hash}|", f"|{source}|", 1)
        tuned = {m for c in kernel.configs for m in c.meta}
        if signature:
            args = value.get("args")
            if rebuilt != entry[len(tuning.SIGNATURE_PREFIX):]:
                found.append((entry, "not the key the runtime builds"))
            elif not isinstance(args, list) or len(args) != len(kernel.runtime_names):
                found.append((entry, f"{len(args) if isinstance(args, list) else args!r} arguments recorded; the "
                                     f"kernel takes {len(kernel.runtime_names)}"))
            elif value.get("constexprs") != {n: v for n, v in constexprs}:
                found.append((entry, f"constexprs {value.get('constexprs')} are not the key's {constexprs}"))
            continue
        if rebuilt != entry or not isinstance(bucket, tuple) or not isinstance(spec, tuple):
            found.append((entry, "not the key the runtime builds"))
        elif any(n not in kernel.constexpr_names or n in tuned for n, _ in constexprs):
            found.append((entry, f"constexprs other than the kernel's untuned ones {kernel.constexpr_names}"))
        elif value.get("config") not in [c.as_dict() for c in kernel.configs]:
            found.append((entry, f"config {value.get('config')} is not one of the kernel's candidates"))
        elif not isinstance(value.get("ms"), float) or not value["ms"] > 0:
            found.append((entry, f"no timing: {value.get('ms')!r}"))
    return found


def _shipped_files():
    """The packaged tuning files of the installed Triton (the only ones it reads)."""
    import triton

    names = sorted(f for f in os.listdir(tuning.PACKAGED_DIR) if f.endswith(".json"))
    assert names, "no tuning file ships with the package"
    assert all(f.startswith("tuning-") and "-triton" in f for f in names), names
    ours = [f for f in names if f.endswith(f"-triton{triton.__version__}.json")]
    if not ours:
        pytest.skip(f"the shipped tuning files are for other Triton versions than {triton.__version__}: {names}")
    return ours


def test_prune_removes_the_shipped_entries_of_edited_kernels(tmp_path):
    shipped = tmp_path / "tuned"
    shipped.mkdir()
    table = {"fwd|aaaa|(64,)": {"config": {"BT": 64}, "ms": 1.0},  # timed on fwd's old source
             "compile|fwd|aaaa|(64,)": {"args": []},  # recorded from it
             "fwd|bbbb|(128,)": {"config": {"BT": 32}, "ms": 1.0},  # fwd's source now
             "bwd|cccc|(64,)": {"config": {"BT": 16}, "ms": 1.0},  # bwd, unedited
             "impl_choice|v2|('fwd', 1)": {"impl": "triton", "ms": {}},  # not a kernel: kept
             "run|2026-01-01T00:00:00+00:00": {"run": "a GPU run"}}
    (shipped / "tuning-GPU_X-triton9.json").write_text(json.dumps(table))
    untouched = {"fwd|bbbb|(64,)": {"config": {"BT": 64}, "ms": 1.0}}
    (shipped / "tuning-GPU_Y-triton9.json").write_text(json.dumps(untouched))
    (shipped / "README.md").write_text("not a tuning file")
    report = tuning.prune(kernels={"fwd": "bbbb", "bwd": "cccc"}, packaged_dir=str(shipped))
    assert [(os.path.basename(p), kept, removed) for p, kept, removed in report] == [
        ("tuning-GPU_X-triton9.json", 4, 2), ("tuning-GPU_Y-triton9.json", 1, 0)]
    assert set(json.load(open(shipped / "tuning-GPU_X-triton9.json"))) == {
        "fwd|bbbb|(128,)", "bwd|cccc|(64,)", "impl_choice|v2|('fwd', 1)", "run|2026-01-01T00:00:00+00:00"}
    assert json.load(open(shipped / "tuning-GPU_Y-triton9.json")) == untouched
    assert (shipped / "README.md").read_text() == "not a tuning file"


def test_every_shipped_tuning_entry_is_found_by_the_current_kernels():
    """Each entry of the shipped files is one the runtime looks up for today's kernels: an entry timed on an
    older source of its kernel (never found, so the kernel is timed again on a user's GPU) fails here. Remove
    such entries, or re-time them and ship them with ``python -m dflash_kernels.runtime.tuning ship``."""
    hashes = tuning.current_kernel_hashes()  # as compiled on a GPU, also under the interpreter
    for f in _shipped_files():
        table = tuning.read_table(os.path.join(tuning.PACKAGED_DIR, f))
        assert table, f"{f}: damaged or empty"
        stale = _unfindable_entries(table, hashes)
        assert not stale, f"{f}: {len(stale)} of {len(table)} entries can never be used:\n" + "\n".join(
            f"  {entry}: {reason}" for entry, reason in stale)


def test_the_shipped_tuning_check_finds_entries_that_cannot_be_used():
    """The check above, on a good shipped entry changed in each way that makes it unusable."""
    hashes = tuning.current_kernel_hashes()
    table = tuning.read_table(os.path.join(tuning.PACKAGED_DIR, _shipped_files()[0]))
    entry, value = next(iter(table.items()))
    name, source, bucket, constexprs, spec = entry.split("|")
    assert _unfindable_entries({entry: value}, hashes) == []
    bad = {
        f"{name}|0000000000000000|{bucket}|{constexprs}|{spec}": value,  # an older kernel source
        f"renamed_kernel|{source}|{bucket}|{constexprs}|{spec}": value,
        f"{name}|{source}|{bucket}|{constexprs}": value,  # the spec missing: not the runtime's key
        f"{name}|{source}|{bucket}|(('NOT_A_CONSTEXPR', 1),)|{spec}": value,
        f"{name}|{source}|{bucket} |{constexprs}|{spec}": value,  # a key the runtime never writes
        f"{name}|{source}|(1, 2, 3)|{constexprs}|{spec}": {**value, "config": {"num_warps": 3}},
    }
    found = dict(_unfindable_entries(bad, hashes))
    assert set(found) == set(bad), {e: found.get(e) for e in bad}
    assert "now " + hashes[name] in found[f"{name}|0000000000000000|{bucket}|{constexprs}|{spec}"]


@pytest.mark.gpu
def test_gpu_packaged_tuning_is_used_and_reported(tmp_path, monkeypatch):
    """A key timed into one cache, shipped as the package's file, is found there by a process with an empty
    cache: nothing is timed and cache_info says "packaged"."""
    import dflash_kernels as dk

    x, w = torch.randn(2, 384, 777, device="cuda"), torch.randn(384, 4, device="cuda")
    monkeypatch.setenv("DFLASH_KERNELS_TUNE", "1")
    monkeypatch.setenv("DFLASH_KERNELS_BACKEND", "conv1d=triton")
    monkeypatch.setenv("DFLASH_KERNELS_CACHE_DIR", str(tmp_path / "timed"))
    dk.reset_cache()
    dk.causal_conv1d(x, w)
    assert {v["tuned_from"] for v in dk.cache_info().values()} == {"timed"}
    monkeypatch.setattr(tuning, "PACKAGED_DIR", str(tmp_path / "timed"))  # that cache as the shipped files
    monkeypatch.setenv("DFLASH_KERNELS_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("DFLASH_KERNELS_PACKAGED_TUNING", "1")
    dk.reset_cache()
    dk.causal_conv1d(x, w)
    assert {v["tuned_from"] for v in dk.cache_info().values()} == {"packaged"}
    assert not os.path.exists(tmp_path / "empty") or not os.listdir(tmp_path / "empty"), "nothing timed here"
    dk.reset_cache()


@pytest.mark.gpu
def test_gpu_tuning_persisted_second_process_does_not_tune(tmp_path):
    code = ("import torch, dflash_kernels as dk\n"
            "dk.causal_conv1d(torch.randn(2, 512, 1000, device='cuda'), torch.randn(512, 4, device='cuda'))\n"
            "print(sorted({v['tuned_from'] for k, v in dk.cache_info().items()}))\n")
    # conv1d pinned to triton: with the CUDA extension built, "auto" may run the extension (no Triton key).
    env = {**os.environ, "DFLASH_KERNELS_CACHE_DIR": str(tmp_path), "DFLASH_KERNELS_TUNE": "1",
           "DFLASH_KERNELS_BACKEND": "conv1d=triton"}
    first = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True)
    second = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True)
    assert "timed" in first.stdout, first.stdout + first.stderr
    assert "['disk']" in second.stdout, second.stdout + second.stderr


@pytest.mark.gpu
def test_gpu_threads_on_fresh_shapes_fwd_bwd(monkeypatch, tmp_path):
    # 8 threads, one GPU, fresh shapes (cold cache, tuning on): no error, results equal one thread.
    monkeypatch.setenv("DFLASH_KERNELS_TUNE", "1")
    monkeypatch.setenv("DFLASH_KERNELS_CACHE_DIR", str(tmp_path))
    dk.reset_cache()
    shapes = [(1, 256 + 64 * i, 1000 + 333 * i) for i in range(8)]

    def run(shape, dtype):
        g = torch.Generator(device="cuda").manual_seed(shape[2])
        x = torch.randn(*shape, device="cuda", dtype=dtype, generator=g, requires_grad=True)
        w = torch.randn(shape[1], 4, device="cuda", dtype=dtype, generator=g, requires_grad=True)
        y = dk.causal_conv1d(x, w, activation="silu")
        gx, gw = torch.autograd.grad(y.float().square().sum(), (x, w))
        torch.cuda.synchronize()
        return y.detach(), gx, gw

    barrier = threading.Barrier(len(shapes))
    results, errors = {}, []

    def worker(i):
        try:
            barrier.wait()
            results[i] = run(shapes[i], [torch.bfloat16, torch.float16][i % 2])
        except BaseException as e:  # noqa: BLE001
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(shapes))]
    [t.start() for t in threads]
    [t.join(timeout=900) for t in threads]
    assert not any(t.is_alive() for t in threads) and not errors, errors
    for i, shape in enumerate(shapes):
        ref = run(shape, [torch.bfloat16, torch.float16][i % 2])
        for a, b in zip(results[i], ref):
            assert torch.equal(a, b), f"thread {i}"
    assert all(v["compiles"] == 1 for v in _conv_keys().values())


def test_fast_key_matches_triton_specialization():
    # The hot path's generated key must separate exactly the argument sets Triton compiles differently.
    from dflash_kernels.ops.conv1d.kernels import conv1d_fwd_kernel as kernel
    x = torch.randn(2, 8, 40)
    w = torch.randn(8, 4)

    def args(x=x, w=w, T=40, stride=320):
        return (x, w, w, x, x, x, x, T, 8, stride, 40, 1, 0, 0, 0, 0, 0, 0, 0)

    fast = kernel._make_fast_spec(args())
    variants = [
        args(), args(T=41), args(T=2 ** 31), args(T=2 ** 63), args(T=-5),
        args(x=x.to(torch.bfloat16)), args(x=torch.randn(2 * 8 * 40 + 1)[1:].view(2, 8, 40)),
        args(stride=1), args(stride=16), args(stride=17),
        args(w=torch.randn(8, 4, dtype=torch.float16)),
    ]
    for a in variants:
        for b in variants:
            same_fast = fast(*a) == fast(*b)
            same_triton = kernel._spec(*a) == kernel._spec(*b)
            assert same_fast == same_triton, (a[7:10], b[7:10])
    # A type the first call did not have (None where a tensor was) is not answered by the fast key.
    assert fast(*(args()[:2] + (None,) + args()[3:])) is None
    assert fast(*(args()[:7] + (40.0,) + args()[8:])) is None
    # A tensor subclass (nn.Parameter) is a tensor to Triton and to the key, whichever came first: a
    # precompile on plain tensors must serve the real call on parameters (strict mode's trainer loop).
    pw = torch.nn.Parameter(w)
    with_param = args(w=pw)
    assert fast(*with_param) == fast(*args())
    assert kernel._make_fast_spec(with_param)(*args()) == fast(*args())


def test_fast_key_of_gluon_descriptors_matches_triton_specialization():
    # A Gluon launcher's arguments (TMA descriptors, tensors, ints, a float): the fast key exists and separates
    # exactly the argument sets Triton compiles differently (dtype, box, layout), not those it does not (the
    # tensor's shape, strides, base).
    pytest.importorskip("triton.experimental.gluon")
    from triton.experimental.gluon.language import NVMMASharedLayout
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from dflash_kernels.ops.gated_delta_rule.kernels_gluon_sm90_fwd import gdn_fwd_gluon_kernel as kernel
    from dflash_kernels.runtime.tma import smem_layout

    def desc(dtype=torch.bfloat16, T=128, H=2, box=(1, 64, 128), padding="zero", layout=None):
        x = torch.empty(2, T, H, 128, dtype=dtype)
        return TensorDescriptor(x, [2, T, H * 128], [x.stride(0), x.stride(1), 1], list(box),
                                layout or smem_layout(box, dtype), padding)

    o, f32, i32 = torch.empty(4, dtype=torch.bfloat16), torch.empty(4), torch.empty(4, dtype=torch.int32)

    def args(q=None, v=None, T=128):
        return (q or desc(), desc(), v or desc(box=(1, 64, 64)), o, f32, f32, o, i32, None, f32, T, 2, 0.1)

    fast = kernel._make_fast_spec(args())
    assert fast is not None and fast(*args()) is not None
    variants = [args(), args(q=desc(T=4096, H=16)), args(q=desc(dtype=torch.float16)),
                args(v=desc(box=(1, 64, 32))), args(v=desc(box=(1, 64, 64), layout=NVMMASharedLayout(64, 16, rank=3))),
                args(q=desc(padding="nan")), args(T=129)]
    for a in variants:
        for b in variants:
            if fast(*a) == fast(*b):  # never one key for two compilations
                assert kernel._spec(*a) == kernel._spec(*b)
    assert fast(*args()) == fast(*variants[1])  # another shape: the same compiled kernel, the same key
    assert fast(*args()) != fast(*variants[2]) and fast(*args()) != fast(*variants[3])
    assert fast(*args()) != fast(*variants[4])  # another shared layout for the same box
    assert fast(*((o,) + args()[1:])) is None  # a tensor where a descriptor was: not answered


def test_config_that_does_not_fit_falls_to_the_next(monkeypatch):
    """Tuning off: the first config runs unless it needs more shared memory than the GPU has (a
    config list written for every head size); then the next that fits, never an error."""
    from triton.runtime.errors import OutOfResources
    kernel = next(k for k in all_kernels() if len(k.configs) > 1)
    tried = []

    def build(config, meta, args, dev):
        tried.append(config)
        if config is kernel.configs[0]:
            raise OutOfResources(360448, 232448, "shared memory")
        return "launcher"

    monkeypatch.setattr(kernel, "_build_launcher", build)
    monkeypatch.setattr(kernel, "interpreted", False)
    cfg, meta, launch = kernel._launcher_that_fits(kernel.configs[0], {}, (), 0)
    assert cfg is kernel.configs[1] and launch == "launcher" and tried == kernel.configs[:2]
    assert meta == dict(kernel.configs[1].meta)

    def never_fits(*a):
        raise OutOfResources(1, 0, "shared memory")

    monkeypatch.setattr(kernel, "_build_launcher", never_fits)
    with pytest.raises(OutOfResources):  # nothing fits: the error, not a silent fallback
        kernel._launcher_that_fits(kernel.configs[0], {}, (), 0)


def test_tune_compile_mode_builds_every_candidate_and_times_none(monkeypatch):
    """DFLASH_KERNELS_TUNE=compile: every candidate is compiled (Triton's disk cache fills), none is
    timed, the first config runs and nothing is written to the tuning store."""
    from dflash_kernels.runtime.kernel import _Entry
    kernel = next(k for k in all_kernels() if len(k.configs) > 2)
    built = []
    monkeypatch.setenv("DFLASH_KERNELS_TUNE", "compile")
    monkeypatch.setattr(kernel, "_build_launcher", lambda config, meta, args, dev: built.append(config))
    monkeypatch.setattr(kernel, "_time_configs", lambda *a: pytest.fail("timed a candidate in compile mode"))
    monkeypatch.setattr(tuning, "store", lambda: pytest.fail("touched the tuning store in compile mode"))
    entry = _Entry()
    assert kernel._choose_config(("k",), (1,), (), {}, 0, entry) is kernel.configs[0]
    assert built == kernel.configs[1:] and entry.tuned_from == "disabled"


class _FakeTimer:
    """Times a candidate as the milliseconds given for its name (the candidate returns its name)."""

    def __init__(self, ms):
        self.ms = ms
        self.calls = []
        self.lock = threading.Lock()

    def __call__(self, fn):
        with self.lock:
            name = fn()
            self.calls.append(name)
            return self.ms[name]


def _candidates():
    return {"cuda": lambda: "cuda", "triton": lambda: "triton"}


def _no_timing(fn):
    raise AssertionError("timed although it must not be")


@pytest.fixture
def fresh_choice(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_KERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DFLASH_KERNELS_TUNE", raising=False)
    choice = dk.runtime.Choice("test_impl", default="triton", label="test choice", version=lambda: "v1")
    yield choice
    choice.reset()


def test_choice_times_once_under_threads_and_persists(fresh_choice):
    cpu = torch.device("cpu")
    timer = _FakeTimer({"triton": 2.0, "cuda": 1.0})
    key = ("fwd", 1)
    results, barrier = [], threading.Barrier(8)

    def worker():
        barrier.wait()
        results.append(fresh_choice.get(cpu, key) or fresh_choice.choose(key, cpu, _candidates(), timer=timer))
    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == ["cuda"] * 8
    assert sorted(timer.calls) == ["cuda", "triton"], "each candidate timed exactly once for the key"
    assert fresh_choice.get(cpu, key) == "cuda"
    saved = tuning.store().get(-1, "test_impl|v1|('fwd', 1)")
    assert saved["impl"] == "cuda" and saved["ms"] == {"triton": 2.0, "cuda": 1.0}

    # A new process (in-memory choices dropped) reads the winner from disk without timing, in strict
    # mode too: nothing needs measuring.
    fresh_choice.reset()
    tuning._store = None
    assert fresh_choice.get(cpu, key) is None
    with dk.strict():
        assert fresh_choice.choose(key, cpu, _candidates(), timer=_no_timing) == "cuda"

    # The slower candidate loses; on a tie the first listed wins.
    slow_cuda = _FakeTimer({"triton": 1.0, "cuda": 3.0})
    assert fresh_choice.choose(("fwd", 2), cpu, _candidates(), timer=slow_cuda) == "triton"
    tie = _FakeTimer({"triton": 1.0, "cuda": 1.0})
    assert fresh_choice.choose(("fwd", 3), cpu, _candidates(), timer=tie) == "cuda"
    # A changed version is a new entry: timed again.
    fresh_choice._version = lambda: "v2"
    fresh_choice.reset()
    again = _FakeTimer({"triton": 2.0, "cuda": 1.0})
    assert fresh_choice.choose(key, cpu, _candidates(), timer=again) == "cuda" and again.calls


@pytest.mark.parametrize("tune", ["0", "compile"])
def test_choice_untimed_takes_the_default(fresh_choice, monkeypatch, tune):
    monkeypatch.setenv("DFLASH_KERNELS_TUNE", tune)
    assert fresh_choice.choose(("fwd", 1), torch.device("cpu"), _candidates(), timer=_no_timing) == "triton"
    assert tuning.store().get(-1, fresh_choice.persist_name(("fwd", 1))) is None, "an untimed choice is not persisted"


def test_choice_strict_mode_raises_on_an_unmeasured_key(fresh_choice):
    with dk.strict():
        with pytest.raises(dk.KernelCacheMiss, match=r"test choice for bucket \('fwd', 1\) is not measured yet"):
            fresh_choice.choose(("fwd", 1), torch.device("cpu"), _candidates(), timer=_no_timing)
    assert fresh_choice.get(torch.device("cpu"), ("fwd", 1)) is None


def test_reset_cache_forgets_choices(fresh_choice):
    cpu = torch.device("cpu")
    fresh_choice.choose(("fwd", 1), cpu, _candidates(), timer=_FakeTimer({"triton": 2.0, "cuda": 1.0}))
    assert fresh_choice.get(cpu, ("fwd", 1)) == "cuda"
    dk.reset_cache()
    assert fresh_choice.get(cpu, ("fwd", 1)) is None


@pytest.fixture
def private_registry(monkeypatch):
    """A copy of the backends' registry and settings, so that a test op leaves no trace."""
    monkeypatch.setattr(backends, "_ops", dict(backends._ops))
    monkeypatch.setattr(backends, "_chosen", {})
    monkeypatch.delenv("DFLASH_KERNELS_BACKEND", raising=False)


def test_op_calls_the_implementation_of_the_resolved_backend(private_registry):
    op = dk.runtime.Op("toy", peers={"peer": "json"}, extra={"ext": lambda: True})
    second = op.function("toy_second")
    op.impl("triton", "interpret")(lambda x: ("kernels", x))
    op.impl("reference")(lambda x: ("reference", x))
    op.impl("peer")(lambda x: ("peer", x))
    op.impl("ext")(lambda x: ("ext", x))
    second.impl("reference")(lambda x: ("second reference", x))
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)  # resolving reads the device type only
    assert op(cuda, 1) == ("kernels", 1)
    assert op(cpu, 2) == ("kernels" if dk.runtime.interpreting() else "reference", 2)
    assert op.backend(cpu) == ("interpret" if dk.runtime.interpreting() else "reference")
    dk.set_backend("toy", "reference")
    assert op(cuda, 3) == ("reference", 3) and second(cuda, 4) == ("second reference", 4)
    dk.set_backend("toy", "peer")
    assert op(cuda, 5) == ("peer", 5)
    with pytest.raises(dk.BackendUnavailable, match="toy_second: backend 'peer' has no implementation"):
        second(cuda, 6)
    with pytest.raises(dk.BackendUnavailable, match="peer backend 'peer' needs CUDA tensors"):
        op(cpu, 7)
    dk.set_backend("toy", "ext")
    assert op(cpu, 8) == ("ext", 8)
    for bad in ("nope", "auto"):
        with pytest.raises(ValueError, match=f"names: '{bad}' is not a backend of op 'toy'"):
            op.impl(bad)


def test_set_backend_refuses_a_backend_that_cannot_run_here(monkeypatch):
    """set_backend checks what does not depend on the inputs (an unbuilt extension, a missing peer, the
    interpreter's setting, no CUDA device) and leaves the setting unchanged when it refuses."""
    from dflash_kernels.ops.conv1d import cuda as conv_cuda
    from dflash_kernels.runtime import backends as be
    before = dk.get_backend("conv1d")
    monkeypatch.setattr(be, "_ops", dict(be._ops))
    be._ops["conv1d"] = dict(be._ops["conv1d"], extra={"cuda": lambda: False})
    with pytest.raises(dk.BackendUnavailable, match="conv1d: backend 'cuda' is not built"):
        dk.set_backend("conv1d", "cuda")
    assert dk.get_backend("conv1d") == before
    be._ops["conv1d"] = dict(be._ops["conv1d"], peers={"causal_conv1d": "no_such_module_here"})
    with pytest.raises(dk.BackendUnavailable, match="peer backend 'causal_conv1d' needs the package"):
        dk.set_backend("conv1d", "causal_conv1d")
    if dk.runtime.interpreting():
        with pytest.raises(dk.BackendUnavailable, match="'triton' is not available under TRITON_INTERPRET=1"):
            dk.set_backend("conv1d", "triton")
    else:
        with pytest.raises(dk.BackendUnavailable, match="'interpret' needs TRITON_INTERPRET=1"):
            dk.set_backend("conv1d", "interpret")
    if not torch.cuda.is_available() and not dk.runtime.interpreting():
        with pytest.raises(dk.BackendUnavailable, match="'triton' needs a CUDA device"):
            dk.set_backend("conv1d", "triton")
    assert dk.get_backend("conv1d") == before
    if not conv_cuda.available():  # the real registry: this build has no extension
        monkeypatch.undo()
        with pytest.raises(dk.BackendUnavailable, match="conv1d: backend 'cuda' is not built"):
            dk.set_backend("conv1d", "cuda")


def _public_ops():
    from dflash_kernels.ops.attention import attention
    from dflash_kernels.ops.conv1d import conv1d
    from dflash_kernels.ops.gated_delta_rule import gated_delta_rule

    def module(name):  # the op module (each op package exports a function of the module's name)
        return importlib.import_module(f"dflash_kernels.ops.{name}.{name}")
    return {"block_sparse_attention": attention._attention, "causal_conv1d": conv1d._conv,
            "causal_conv1d_update": conv1d._conv_update, "chunk_gated_delta_rule": gated_delta_rule._gdn,
            "fused_recurrent_gated_delta_rule": gated_delta_rule._gdn_recurrent,
            "linear_cross_entropy": module("linear_cross_entropy")._op, "rms_norm": module("rms_norm")._op,
            "apply_rope": module("rope")._op, "swiglu": module("swiglu")._op,
            "swiglu_packed": module("swiglu")._op_packed}


@pytest.mark.parametrize("function", sorted(_public_ops()))
def test_every_backend_of_every_public_function_is_implemented(function):
    op = _public_ops()[function]
    assert set(op._impls) == set(backends._names(op.name)) - {"auto"}


def _reference_calls(function):
    """(naive module, naive function name, a call of the public function on small CPU inputs, its mask
    built inside the call)."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g)
    if function == "block_sparse_attention":
        from dflash_kernels.ops.attention import naive
        return naive, "masked_block_sparse_attention", lambda: dk.block_sparse_attention(
            rand(1, 8, 2, 64), rand(1, 16, 1, 64), rand(1, 16, 1, 64),
            dk.dflash_block_mask(torch.tensor([[3, 7]]), 8, 4, kv_tile=16))
    if function.startswith("causal_conv1d"):
        from dflash_kernels.ops.conv1d import naive
        if function == "causal_conv1d":
            return naive, "naive_causal_conv1d", lambda: dk.causal_conv1d(rand(1, 4, 8), rand(4, 4), None, "silu")
        return naive, "naive_causal_conv1d_update", lambda: dk.causal_conv1d_update(
            rand(1, 4), rand(1, 4, 3), rand(4, 4), None, "silu")
    if function == "linear_cross_entropy":
        from dflash_kernels.ops.linear_cross_entropy import naive
        return naive, "naive_linear_cross_entropy", lambda: dk.linear_cross_entropy(
            rand(6, 8), rand(11, 8), torch.randint(0, 11, (6,), generator=g))
    if function == "rms_norm":
        from dflash_kernels.ops.rms_norm import naive
        return naive, "naive_rms_norm", lambda: dk.rms_norm(rand(3, 16), rand(16))
    if function == "apply_rope":
        from dflash_kernels.ops.rope import naive
        return naive, "naive_apply_rope", lambda: dk.apply_rope(rand(1, 4, 2, 16), rand(1, 4, 16), rand(1, 4, 16))
    if function.startswith("swiglu"):
        from dflash_kernels.ops.swiglu import naive
        if function == "swiglu":
            return naive, "naive_swiglu", lambda: dk.swiglu(rand(3, 8), rand(3, 8))
        return naive, "naive_swiglu_packed", lambda: dk.swiglu_packed(rand(3, 16))
    from dflash_kernels.ops.gated_delta_rule import naive
    q, k, v = rand(1, 5, 1, 16), torch.nn.functional.normalize(rand(1, 5, 1, 16), dim=-1), rand(1, 5, 2, 16)
    g_, beta = -torch.rand(1, 5, 2, generator=g), torch.rand(1, 5, 2, generator=g)
    return naive, "naive_recurrent_gated_delta_rule", lambda: getattr(dk, function)(
        q, k, v, g_, beta, output_final_state=True)


@pytest.mark.parametrize("function", sorted(_public_ops()))
def test_reference_backend_runs_the_naive_reference(monkeypatch, function):
    """Backend ``reference``: the public function's result is the naive reference's (the mask's reverse
    index built with tensor ops, not the kernels)."""
    from dflash_kernels.ops.attention import mask as mask_module

    def no_kernels(*args):
        raise AssertionError("the reverse index was built by the kernels under the reference backend")
    monkeypatch.setattr(mask_module, "_reverse_index_triton", no_kernels)
    op = _public_ops()[function]
    module, name, call = _reference_calls(function)
    real, calls = getattr(module, name), []

    def recorded(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, recorded)
    try:
        dk.set_backend(op.name, "reference")
        out = call()
    finally:
        dk.set_backend(op.name, "auto")
    assert calls == [name]
    first = out[0] if isinstance(out, tuple) else out
    assert isinstance(first, torch.Tensor) and torch.isfinite(first).all()


def test_reference_module_exports_each_naive_reference_under_its_names():
    from dflash_kernels import reference
    from dflash_kernels.ops.attention import naive as attention_naive
    from dflash_kernels.ops.conv1d import naive as conv_naive
    from dflash_kernels.ops.gated_delta_rule import naive as gdn_naive
    assert reference.sdpa_dense is reference.naive_block_sparse_attention is attention_naive.naive_block_sparse_attention
    assert reference.dense_mask is reference.naive_dense_mask is attention_naive.naive_dense_mask
    assert reference.causal_conv1d_ref is reference.naive_causal_conv1d is conv_naive.naive_causal_conv1d
    assert reference.causal_conv1d_update_ref is conv_naive.naive_causal_conv1d_update
    assert reference.naive_recurrent_gated_delta_rule is gdn_naive.naive_recurrent_gated_delta_rule
    assert all(hasattr(reference, name) for name in reference.__all__)


def test_differentiable_op_skips_autograd_when_nothing_needs_a_gradient():
    """No grad mode or no input requiring grad: the implementation runs alone (no autograd node, the host
    cost of a frozen model's forward); a Parameter or tensor that requires grad takes the autograd path."""
    from dflash_kernels.runtime.autograd import differentiable_op

    calls = []
    def impl(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * 2 * w

    lib = torch.library.custom_op("dflash_kernels_test::double_it", mutates_args=())(impl)
    lib.register_fake(lambda x, w: torch.empty_like(x))

    def setup_context(ctx, inputs, output):
        calls.append("setup")
        ctx.save_for_backward(*inputs)

    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return dy * 2 * w, (dy * 2 * x).sum(0)

    op = differentiable_op(lib, impl, setup_context, backward)
    x, w = torch.randn(3, 4), torch.nn.Parameter(torch.randn(4))
    with torch.no_grad():
        y = op(x, w)
    assert calls == [] and not y.requires_grad and y.grad_fn is None
    y = op(x, w.detach())
    assert calls == [] and y.grad_fn is None
    y = op(x, w)  # a Parameter (not exactly torch.Tensor) that requires grad
    assert calls == ["setup"] and y.requires_grad
    (gw,) = torch.autograd.grad(y.sum(), w)
    torch.testing.assert_close(gw, 2 * x.sum(0))
