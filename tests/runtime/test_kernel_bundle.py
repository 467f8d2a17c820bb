"""Compiled-kernel bundles (runtime/kernel_bundle.py), the recorded launches' tags and the command line
``python -m dflash_kernels.precompile``. A real kernel is compiled for sm_90 on the CPU (Triton ships ptxas), so
the round trip through a bundle is checked against Triton's own cache lookup."""

import importlib
import json
import os
import subprocess
import sys
import tarfile

import pytest
import torch
import triton
import triton.language as tl

import dflash_kernels as dk
from dflash_kernels.runtime import kernel_bundle as kb
from dflash_kernels.runtime import settings, tuning

pc = importlib.import_module("dflash_kernels.runtime.precompile")
MACHINE = {"arch": "sm_90", "triton": triton.__version__, "cuda_driver": "13.0"}


ROUND_TRIP = r"""
import json, os, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dflash_kernels.runtime import kernel_bundle as kb

@triton.jit
def _add(x, y, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    tl.store(x + o, tl.load(x + o, mask=m) + tl.load(y + o, mask=m), mask=m)

def compile_sm90():
    src = ASTSource(_add, signature={"x": "*fp32", "y": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                    constexprs={"BLOCK": 128})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32))

tmp, machine = sys.argv[1], json.loads(sys.argv[2])
os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, "first")
first = compile_sm90()
files = kb.entry_files(first)
path = os.path.join(tmp, "b.tar.xz")
kb.pack(path, dict(machine, signatures=["kern|h|()"]), files)
os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, "second")
installed = kb.install(path, machine=machine)
again = compile_sm90()
print("RESULT " + json.dumps({"first_asm": sorted(first.asm), "files": sorted(files), "installed": installed["installed"],
      "present": installed["present"], "skipped": installed["skipped"], "again_asm": sorted(again.asm),
      "same_hash": again.hash == first.hash, "same_cubin": again.asm["cubin"] == first.asm["cubin"],
      "second_install_present": kb.install(path, machine=machine)["present"]}))
"""


def _bundle(tmp_path, files, manifest=None, name="b.tar.xz"):
    """A bundle with a format-1 manifest (one GPU model, "GPU A", at its top) unless ``manifest`` says otherwise."""
    path = str(tmp_path / name)
    kb.pack(path, dict(MACHINE, gpu="GPU A", signatures=["kern|h|()"], **(manifest or {})), files)
    return path


def _shipped_setup(tmp_path, monkeypatch, gpu="GPU A"):
    """ensure_shipped on "device 0" of model ``gpu``, this MACHINE, with an empty cache and shipped folder."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kb, "SHIPPED_DIR", str(tmp_path / "shipped"))
    monkeypatch.setattr(kb, "bundle_key", lambda dev: dict(MACHINE))
    monkeypatch.setattr(kb, "gpu_model", lambda dev: gpu)
    monkeypatch.setattr(settings, "interpreting", lambda: False)
    monkeypatch.setattr(kb, "_checked", {})
    (tmp_path / "shipped").mkdir(exist_ok=True)


def test_a_bundle_installed_into_an_empty_cache_is_what_triton_finds(tmp_path):
    """A kernel compiled for sm_90 (on the CPU: Triton ships ptxas), packed, installed into an empty cache folder:
    Triton's own lookup then finds it there and compiles nothing. Run in a process without TRITON_INTERPRET,
    whose patches of ``triton.language`` would break a real compile in this one."""
    script = tmp_path / "round_trip.py"
    script.write_text(ROUND_TRIP)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    out = subprocess.run([sys.executable, str(script), str(tmp_path), json.dumps(MACHINE)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    assert {"cubin", "ptx", "ttir"} <= set(r["first_asm"])  # compiled the first time: every stage
    assert [n.rpartition("/")[2] for n in r["files"]] == ["_add.cubin", "_add.json"]
    assert (r["installed"], r["present"], r["skipped"]) == (1, 0, None)
    assert r["again_asm"] == ["cubin"]  # found in the installed entry: nothing was compiled
    assert r["same_hash"] and r["same_cubin"] and r["second_install_present"] == 1


@pytest.mark.parametrize("field,value", [("arch", "sm_80"), ("triton", "0.0.0"), ("cuda_driver", "12.8")])
def test_a_bundle_of_another_machine_is_not_installed(tmp_path, monkeypatch, field, value):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    path = _bundle(tmp_path, {"ENTRY/k.json": b"{}", "ENTRY/k.cubin": b"x"}, {field: value})
    report = kb.install(path, machine=MACHINE)
    assert report["installed"] == 0 and field in report["skipped"] and value in report["skipped"]
    assert not (tmp_path / "cache" / "ENTRY").exists()
    forced = kb.install(path, machine=MACHINE, force=True)
    assert forced["installed"] == 1
    group = json.loads((tmp_path / "cache" / "ENTRY" / "__grp__k.json").read_text())
    assert group["child_paths"] == {n: str(tmp_path / "cache" / "ENTRY" / n) for n in ("k.cubin", "k.json")}


def test_host_modules_are_copied_without_a_group_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    path = _bundle(tmp_path, {"LAUNCH/__triton_launcher.so": b"\x7fELF"})
    assert kb.install(path, machine=MACHINE)["installed"] == 1
    assert os.listdir(tmp_path / "cache" / "LAUNCH") == ["__triton_launcher.so"]


@pytest.mark.parametrize("member", ["../evil.json", "a/b/c.json", "/abs.json", "x/.."])
def test_a_bundle_with_paths_outside_the_cache_is_refused(tmp_path, monkeypatch, member):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    path = _bundle(tmp_path, {member: b"{}"})
    with pytest.raises(ValueError, match="unexpected member"):
        kb.install(path, machine=MACHINE)


def test_the_shipped_bundle_is_installed_once_and_marked(tmp_path, monkeypatch):
    _shipped_setup(tmp_path, monkeypatch)
    _bundle(tmp_path / "shipped", {"ENTRY/k.json": b"{}", "ENTRY/k.cubin": b"x"}, name=kb.bundle_name(MACHINE))
    assert kb.ensure_shipped(0) == {"kern|h|()"}
    assert (tmp_path / "cache" / "ENTRY" / "__grp__k.json").exists()
    (marker,) = [n for n in os.listdir(tmp_path / "cache") if n.startswith(".dflash_kernels-shipped-")]
    # another process (a cleared memo) reads the marker and copies nothing
    monkeypatch.setattr(kb, "_checked", {})
    monkeypatch.setattr(kb, "install", lambda *a, **k: pytest.fail("installed twice"))
    assert kb.ensure_shipped(0) == {"kern|h|()"}
    monkeypatch.setenv("DFLASH_KERNELS_SHIPPED_KERNELS", "0")
    monkeypatch.setattr(kb, "_checked", {})
    assert kb.ensure_shipped(0) == set()


def test_no_shipped_bundle_for_this_machine_installs_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kb, "SHIPPED_DIR", str(tmp_path / "shipped"))
    monkeypatch.setattr(kb, "bundle_key", lambda dev: dict(MACHINE, arch="sm_100"))
    monkeypatch.setattr(settings, "interpreting", lambda: False)
    monkeypatch.setattr(kb, "_checked", {})
    assert kb.ensure_shipped(0) == set()


def test_a_damaged_shipped_bundle_warns_and_compiles(tmp_path, monkeypatch):
    _shipped_setup(tmp_path, monkeypatch)
    (tmp_path / "shipped" / kb.bundle_name(MACHINE)).write_bytes(b"not an archive")
    with pytest.warns(RuntimeWarning, match="could not be installed"):
        assert kb.ensure_shipped(0) == set()


def test_a_bundle_written_per_gpu_model_keeps_the_other_models(tmp_path):
    """``write_bundle(merge=True)`` (what ``--export-kernels shipped`` does): the H100's and the H200's kernels in
    one sm_90 bundle, each model's launches listed apart; a model written again replaces only its own entry; a
    bundle of another key, or ``merge=False``, is replaced whole. A format-1 bundle becomes one model's entry."""
    path = str(tmp_path / "b.tar.xz")
    entry = lambda sig: dict(run="r", created="c", tags=None, kernels=1, signatures=[sig])  # noqa: E731
    kb.write_bundle(path, MACHINE, "GPU A", entry("a|1|()"), {"E1/k.cubin": b"1", "E1/k.json": b"{}"}, merge=True)
    m = kb.write_bundle(path, MACHINE, "GPU B", entry("b|1|()"), {"E2/k.cubin": b"2", "E2/k.json": b"{}",
                                                                 "L/__triton_launcher.so": b"so"}, merge=True)
    assert sorted(m["models"]) == ["GPU A", "GPU B"] and (m["kernels"], m["host_modules"]) == (2, 1)
    assert kb.model_signatures(kb.read_manifest(path), "GPU A") == ["a|1|()"]
    assert kb.model_signatures(kb.read_manifest(path), "GPU B") == ["b|1|()"]
    assert kb.model_signatures(kb.read_manifest(path), "GPU C") == []
    assert sorted(kb.unpack(path)[1]) == ["E1/k.cubin", "E1/k.json", "E2/k.cubin", "E2/k.json", "L/__triton_launcher.so"]
    m = kb.write_bundle(path, MACHINE, "GPU A", entry("a|2|()"), {"E3/k.cubin": b"3", "E3/k.json": b"{}"}, merge=True)
    assert kb.model_signatures(m, "GPU A") == ["a|2|()"] and kb.model_signatures(m, "GPU B") == ["b|1|()"]
    m = kb.write_bundle(path, dict(MACHINE, cuda_driver="12.8"), "GPU A", entry("a|3|()"), {"E4/k.cubin": b"4"},
                        merge=True)
    assert sorted(m["models"]) == ["GPU A"] and sorted(kb.unpack(path)[1]) == ["E4/k.cubin"]
    kb.write_bundle(path, MACHINE, "GPU B", entry("b|2|()"), {"E5/k.cubin": b"5"}, merge=False)
    assert sorted(kb.read_manifest(path)["models"]) == ["GPU B"] and sorted(kb.unpack(path)[1]) == ["E5/k.cubin"]
    old = _bundle(tmp_path, {"E6/k.cubin": b"6"}, name="old.tar.xz")  # format 1, "GPU A"
    assert kb.model_signatures(kb.read_manifest(old), "GPU A") == ["kern|h|()"]
    assert kb.model_signatures(kb.read_manifest(old), "GPU B") == []
    m = kb.write_bundle(old, MACHINE, "GPU B", entry("b|1|()"), {"E7/k.cubin": b"7"}, merge=True)
    assert kb.model_signatures(m, "GPU A") == ["kern|h|()"] and kb.model_signatures(m, "GPU B") == ["b|1|()"]


@pytest.mark.parametrize("gpu,expected", [("GPU A", {"a|1|()"}), ("GPU B", {"b|1|()"}), ("GPU C", set())])
def test_the_shipped_bundle_covers_only_the_launches_of_this_gpu_model(tmp_path, monkeypatch, gpu, expected):
    """Every model's files are installed (Triton's hashes pick what it needs), but only this model's launches count
    as covered: another model's tuned configs may differ, so precompile must still compile those here."""
    _shipped_setup(tmp_path, monkeypatch, gpu)
    path = str(tmp_path / "shipped" / kb.bundle_name(MACHINE))
    for model, sig, e in (("GPU A", "a|1|()", "E1"), ("GPU B", "b|1|()", "E2")):
        kb.write_bundle(path, MACHINE, model, dict(run="r", created="c", tags=None, kernels=1, signatures=[sig]),
                        {f"{e}/k.json": b"{}", f"{e}/k.cubin": b"x"}, merge=True)
    assert kb.ensure_shipped(0) == expected
    assert (tmp_path / "cache" / "E1" / "__grp__k.json").exists() and (tmp_path / "cache" / "E2").exists()
    monkeypatch.setattr(kb, "_checked", {})  # another process: the marker of this model says the same
    assert kb.ensure_shipped(0) == expected


def test_bundle_names_carry_the_machine_key():
    assert kb.bundle_name(MACHINE) == f"kernels-sm90-triton{triton.__version__}-cuda13.0.tar.xz"


def test_every_shipped_bundle_is_readable_and_named_by_its_manifest():
    names = [n for n in os.listdir(kb.SHIPPED_DIR)] if os.path.isdir(kb.SHIPPED_DIR) else []
    for name in names:
        if name.endswith(".md"):
            continue
        manifest = kb.read_manifest(os.path.join(kb.SHIPPED_DIR, name))
        assert kb.bundle_name(manifest) == name and manifest["format"] == kb.FORMAT and manifest["models"]
        for model, entry in manifest["models"].items():
            # launches that differ only in what Triton does not specialize on share one compiled kernel
            assert entry["run"] and model in entry["run"], f"{name}: {model}'s entry does not name its run"
            assert entry["signatures"] and 0 < entry["kernels"] <= len(entry["signatures"])
        with tarfile.open(os.path.join(kb.SHIPPED_DIR, name), "r:xz") as tar:
            cubins = [m.name for m in tar.getmembers() if m.name.endswith(".cubin")]
        assert len(cubins) == manifest["kernels"] >= max(e["kernels"] for e in manifest["models"].values())


# ------------------------------------------------------------------------------------------ recorded tags


def _fake_kernel(name):
    from dflash_kernels.runtime import Config, TritonKernel

    def body(x, n, BLOCK: tl.constexpr):
        pass

    class _Jit:
        def __init__(self):
            self.fn = body

    k = TritonKernel(_Jit(), name=name, configs=[Config(BLOCK=16), Config(BLOCK=32)])
    k.interpreted = False
    return k


def test_launches_are_tagged_with_the_runs_that_recorded_them(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_KERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DFLASH_KERNELS_PACKAGED_TUNING", "0")
    k = _fake_kernel("fake_tagged")
    args = (torch.zeros(4), 3)
    key = ((4,), (), k._spec(*args), -1)
    name = tuning.SIGNATURE_PREFIX + k._persist_name(key)
    k._record_signature(key, args, {}, -1)
    assert "tags" not in tuning.store().get(-1, name)  # untagged run: no tags
    monkeypatch.setenv("DFLASH_KERNELS_RECORD_TAG", "real, ops")
    k._record_signature(key, args, {}, -1)
    assert tuning.store().get(-1, name)["tags"] == ["ops", "real"]
    monkeypatch.setenv("DFLASH_KERNELS_RECORD_TAG", "27b")
    k._record_signature(key, args, {}, -1)
    assert tuning.store().get(-1, name)["tags"] == ["27b", "ops", "real"]  # merged, never dropped


def test_precompile_recorded_takes_only_the_tagged_launches_and_skips_shipped_ones(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(settings, "interpreting", lambda: False)
    monkeypatch.setattr(pc, "gpu_model", lambda index: "FAKE_GPU_TAGS")
    ks = pc.all_kernels()[:4]
    names = [f"{k.name}|{k._source_hash}|()|()|()" for k in ks]
    entries = {tuning.SIGNATURE_PREFIX + n: {"args": [], "constexprs": {}, "tags": [t]}
               for n, t in zip(names, ["real", "real", "real", "27b"])}
    monkeypatch.setattr(tuning.TuningStore, "entries", lambda self, dev, prefix: dict(entries))
    monkeypatch.setattr(tuning.TuningStore, "get", lambda self, dev, name: None)
    monkeypatch.setattr(pc.kernel_bundle, "ensure_shipped", lambda dev: {names[0]})
    seen = []
    monkeypatch.setattr(pc, "_run_workers", lambda job, w, v, mode=None: (seen.append(sorted(job["signatures"])),
                                                                          (len(job["signatures"]), []))[1])
    monkeypatch.setattr(pc, "_done", set())
    rep = pc.precompile_recorded(device="cuda:0", workers=2, verbose=False, tags=["real"])
    assert rep["recorded"] == rep["current"] == 3 and rep["shipped"] == 1 and rep["compiled"] == 2
    assert seen == [sorted(tuning.SIGNATURE_PREFIX + n for n in names[1:3])]


# ------------------------------------------------------------------------------------------ command line

cli = importlib.import_module("dflash_kernels.precompile")


def test_the_package_function_stays_callable_after_the_cli_module_is_imported():
    assert callable(dk.precompile)
    rep = dk.precompile([("swiglu", dict(N=4, C=16), torch.float32)], backward=False, verbose=False)
    assert rep["items"][0]["op"] == "swiglu"


@pytest.mark.parametrize("text,expected", [
    ("gdn:B=1,T=8192", ("gdn", {"B": 1, "T": 8192})),
    ("attention: B=1, window=null, D=128", ("attention", {"B": 1, "window": None, "D": 128})),
    ("gdn:B=2,gate_in_kernel=true,name=x", ("gdn", {"B": 2, "gate_in_kernel": True, "name": "x"})),
])
def test_op_specs_parse(text, expected):
    assert cli.parse_op(text) == expected


@pytest.mark.parametrize("argv,message", [
    ([], "nothing to do"),
    (["--op", "gdn"], "expected OP:KEY=VALUE"),
    (["--op", "gdn:B"], "is not KEY=VALUE"),
    (["--op", "gdn:B=1", "--dtype", "bf17"], "--dtype: 'bf17'"),
])
def test_bad_command_lines_say_what_is_wrong(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(argv)
    assert message in capsys.readouterr().err


def test_an_op_spec_missing_a_size_names_it(capsys):
    assert cli.main(["--op", "swiglu:N=4", "--dtype", "float32"]) == 2
    err = capsys.readouterr().err
    assert "swiglu" in err and "'C'" in err and "rows of" in err


def test_an_unknown_op_is_named(capsys):
    assert cli.main(["--op", "nope:N=4"]) == 2
    assert "unknown op 'nope'" in capsys.readouterr().err


def test_the_cli_runs_op_specs_and_says_nothing_compiles_on_the_cpu(capsys):
    assert cli.main(["--op", "swiglu:N=4,C=16", "--dtype", "float32", "--forward-only", "--preset", "real,ops",
                     "--list"]) == 0
    out = capsys.readouterr().out
    assert "precompilable ops:" in out and "gdn" in out
    assert "--preset ops: nothing to compile on the CPU" in out and "--preset real: nothing to compile" in out
    assert "--op swiglu {'N': 4, 'C': 16} torch.float32 on the CPU" in out


def test_preset_ops_shapes_are_precompilable_specs():
    for op, shape in cli.OP_SHAPES:
        assert op in pc._builders, op
        assert all(isinstance(v, (int, type(None))) for k, v in shape.items() if k != "docs"), shape
    packed = [s for op, s in cli.OP_SHAPES if op == "gdn" and "docs" in s]
    assert packed and all(sum(map(int, s["docs"].split("+"))) == s["T"] and s["B"] == 1 for s in packed)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1", reason="runs the kernels: the interpreter")
def test_gdn_precompile_spec_of_a_packed_batch_runs_the_varlen_op(monkeypatch):
    """``docs`` makes the spec a packed batch: the op is called with cu_seqlens (its varlen kernels)."""
    import dflash_kernels.ops.gated_delta_rule.gated_delta_rule as gdn

    seen = []
    real = gdn.chunk_gated_delta_rule
    monkeypatch.setattr(gdn, "chunk_gated_delta_rule", lambda *a, **k: seen.append(k["cu_seqlens"]) or real(*a, **k))
    pc._builders["gdn"](dict(B=1, T=50, Hk=1, Hv=2, K=16, V=16, docs="20+30"), torch.float32, "cpu", True)
    assert seen[0].tolist() == [0, 20, 50]
    with pytest.raises(ValueError, match="docs"):
        pc._builders["gdn"](dict(B=2, T=50, Hk=1, Hv=2, K=16, V=16, docs="20+30"), torch.float32, "cpu", False)
