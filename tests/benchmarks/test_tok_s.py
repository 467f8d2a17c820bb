"""benchmarks/tok_s.py: the CPU tiny path runs end to end, and its flex peer computes the drafter's attention."""

import os
import subprocess
import sys
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import tok_s  # noqa: E402


def test_cpu_tiny_run_prints_a_table(tmp_path):
    out_json = tmp_path / "rows.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "tok_s.py"), "--device", "cpu",
                           "--steps", "1", "--warmup", "0", "--json", str(out_json)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "No CUDA device: a tiny configuration on the CPU" in out
    assert "{'preset'" not in out  # the rows' records only with --verbose
    assert "  tiny (a): 0 warm-up step(s), the shape pass, then 1 timed ..." in out
    table = out[out.index("preset | group"):].splitlines()
    header = [c.strip() for c in table[0].split("|")]
    assert header[:4] == ["preset", "group", "tokens/s", "ms/step"] and "a / this" in header
    assert not {"MFU", "TFLOP/step", "GPU idle ms", "peak GiB", "mask ms"} & set(header), header  # GPU columns
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")] for line in table[2:5]}
    for label in ("(a) dflash_kernels", "(c) reference"):
        assert float(rows[label][2].replace(",", "")) > 0, table
    assert rows["(b) peers"][2] == "-" and "skipped" in out
    legend = table[table.index("columns:") + 1:]
    assert any(s.startswith("  a / this: group (a)'s tokens/s over this row's") for s in legend), legend
    import json
    recs = {r["group"]: r for r in json.loads(out_json.read_text())["rows"]}
    a, c = recs["(a) dflash_kernels"], recs["(c) reference"]
    assert a["tok_s"] > 0 and c["tok_s"] > 0 and a["tokens_per_step"] == c["tokens_per_step"] == 128
    assert "attn=interpret" in a["backends"] and "gdn=reference" in c["backends"]
    # Same drafter init and batch: the first losses agree when the backends compute the same thing.
    assert abs(a["loss_step1"] - c["loss_step1"]) < 1e-3 * abs(c["loss_step1"])
    assert c["a_over_this"] == pytest.approx(a["tok_s"] / c["tok_s"]) and a["a_over_this"] == 1.0


@pytest.mark.slow
def test_group_e_is_a_with_the_eager_elementwise_chains(tmp_path):
    # (a) runs the fused norm / RoPE / SwiGLU ops on a GPU, (e) the plain chains; on the CPU both run the
    # plain chains (the ops would run the interpreter), say so, and compute the same.
    plan_a, plan_e = tok_s.group_plan("a", torch.device("cuda")), tok_s.group_plan("e", torch.device("cuda"))
    assert plan_a["elementwise"] is True and plan_e["elementwise"] is False
    assert plan_e["backends"] == plan_a["backends"] and plan_e["loss"] == plan_a["loss"] == "fused"
    out_json = tmp_path / "rows.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "tok_s.py"), "--device", "cpu",
                           "--groups", "a,e", "--steps", "1", "--warmup", "0", "--json", str(out_json)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json
    recs = {r["group"]: r for r in json.loads(out_json.read_text())["rows"]}
    a, e = recs["(a) dflash_kernels"], recs["(e) (a) with eager norm/RoPE/SwiGLU"]
    assert a["elementwise"] == e["elementwise"] == "eager"
    assert e["loss_step1"] == pytest.approx(a["loss_step1"], rel=1e-6)


def test_run_group_sets_and_restores_the_drafter_path(monkeypatch):
    """Every group sets trainer.model.FUSED_OPS for its row (fused for (a) on a GPU only) and restores it."""
    import trainer.model as drafter_model

    seen = []
    monkeypatch.setattr(tok_s, "_run_group", lambda *a: seen.append(drafter_model.FUSED_OPS) or {})
    monkeypatch.setattr(drafter_model, "FUSED_OPS", "auto")
    setup = tok_s.Setup("x", None, None, None, "")
    for g in ("a", "e", "c"):
        tok_s.run_group(setup, g, 1, 0, torch.device("cpu"), torch.float32)
    assert seen == [False, False, False] and drafter_model.FUSED_OPS == "auto"


def test_flex_peer_matches_the_reference_attention():
    import dflash_kernels as dk
    from trainer.model import DFlashDrafter, DrafterConfig

    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=64, intermediate_size=96, vocab_size=100, num_layers=2, num_heads=2,
                        num_kv_heads=1, head_dim=64, block_size=4, target_layer_ids=[0, 1],
                        layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    drafter = DFlashDrafter(cfg)
    B, S, N = 2, 21, 3
    anchors = torch.tensor([[2, 9, 15], [0, 7, 17]])
    valid = torch.tensor([[True, True, True], [True, False, True]])
    emb = torch.randn(B, N * 4, 64)
    feats = torch.randn(B, S, 128)
    dk.set_backend("attention", "reference")
    try:
        with torch.no_grad():  # flex has no CPU backward; the GPU run exercises it
            ref = drafter(emb, feats, anchors, valid)
    finally:
        dk.set_backend("attention", "auto")
    tok_s.FlexDrafterAttention(drafter, compiled=False)
    with torch.no_grad():
        out = drafter(emb, feats, anchors, valid)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,cat", [
    ("_gdn_fwd_scan_kernel", "gdn"), ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "gdn"),
    ("recompute_w_u_fwd_kernel", "gdn"), ("l2norm_fwd_kernel", "gdn"),
    ("_conv1d_fwd_kernel", "conv"), ("causal_conv1d_fwd_kernel", "conv"),
    ("void dflash::(anonymous namespace)::fwd_channel_last_kernel<__nv_bfloat16, 4>(DflashConvParams, long, bool)",
     "conv"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>", "loss"),
    ("_attention_bwd_dkdv_kernel", "attention"), ("_attention_mask_rev_fill_kernel", "attention"),
    ("triton_tem_fused_flex_attention_backward_1", "attention"), ("_linear_ce_rows_kernel", "loss"),
    ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "gemm"),
    ("Optimizer.step#AdamW.step", "optimizer"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda>", "copies/casts"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel>", "norm/rope/activation"),
    ("_swiglu_fwd_kernel", "norm/rope/activation"), ("_rope_kernel", "norm/rope/activation"),
    ("_triton_rope", "norm/rope/activation"), ("_swiglu_forward_kernel", "norm/rope/activation"),
    ("Memset (Device)", "other"),
])
def test_profile_categories(name, cat):
    """--profile's per-category sums: ours and the peers' kernel names land in the right category
    (the conv's CUDA kernels carry "dflash" in their namespace and must not count as attention)."""
    assert tok_s.category(name) == cat


def test_profile_counts_every_attention_kernel_as_attention():
    """Every kernel the attention op launches (the portable ones, the Hopper Gluon forwards and backward, the mask
    builders), found in its modules, shows in the profile under its function's name in category attention."""
    import importlib
    import pkgutil

    import dflash_kernels.ops.attention as pkg
    from dflash_kernels.runtime import TritonKernel

    names = set()
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        names |= {k.fn.__name__ for k in vars(module).values() if isinstance(k, TritonKernel)}
    assert {"_attn_fwd_dflash_ws_kernel", "_attn_bwd_dkdv_ws_kernel", "_attn_bwd_dq_ws_kernel",
            "_attention_fwd_ws_kernel", "_attention_bwd_dkdv_kernel"} <= names
    assert {name: tok_s.category(name) for name in names} == dict.fromkeys(names, "attention")


def test_profile_on_cpu_says_it_is_skipped():
    lines = []
    tok_s.profile_steps(lambda: None, 1, torch.device("cpu"), "tiny (a)", lines.append)
    assert lines == ["    profile tiny (a): skipped (the device-time breakdown needs a GPU)"]


def test_kernel_times_leave_out_record_function_ranges():
    """A record_function range shows on the device timeline too (torch's ``Optimizer.step#AdamW.step``
    around the fused AdamW kernel): counted, its kernels would count twice. A
    compiled Triton kernel named like its host-side launch record (flex attention's ``triton_tem_*``)
    is a kernel and stays (else (b)'s attention would be lost)."""
    from types import SimpleNamespace as E
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def ev(name, dtype, start, end, **kw):
        return E(name=name, device_type=dtype, time_range=E(start=start, end=end),
                 device_time_total=float(end - start) if dtype == cuda else 0.0, **kw)

    events = [ev("Optimizer.step#AdamW.step", cpu, 0, 50),
              ev("Optimizer.step#AdamW.step", cuda, 100, 9440),  # spans the AdamW kernel
              ev("multi_tensor_apply_kernel<FusedAdamW>", cuda, 120, 9380),
              ev("triton_tem_fused_flex_attention_0", cpu, 60, 70),  # inductor's launch record
              ev("triton_tem_fused_flex_attention_0", cuda, 10000, 13000),
              ev("nvjet_sm90_tst_192x192", cuda, 13000, 15000),
              ev("nvjet_sm90_tst_192x192", cuda, 15000, 17000),
              ev("my_range", cuda, 17000, 17500, is_user_annotation=True),
              ev("aten::mm", cpu, 80, 90)]
    assert tok_s.kernel_ms(events, 2) == {"multi_tensor_apply_kernel<FusedAdamW>": 4.63,
                                          "triton_tem_fused_flex_attention_0": 1.5,
                                          "nvjet_sm90_tst_192x192": 2.0}


def test_kernel_sources_name_the_outermost_aten_op_and_the_caller():
    """--profile-sources: a copy kernel is attributed to the outermost ATen op above its launch (here
    ``aten::contiguous``, not the ``aten::copy_`` inside it) with that op's shapes, and to the first Python
    frames above it outside torch (``with_stack`` records them as parent events, as torch 2.13's profiler
    does on the CPU); a backward kernel to its autograd node. Kernels of other categories and groups under
    the threshold are left out."""
    from types import SimpleNamespace as E

    def node(name, parent=None, kernels=(), shapes=()):
        return E(name=name, cpu_parent=parent, kernels=list(kernels), input_shapes=list(shapes))

    k = lambda name, us: E(name=name, duration=us)
    py = node("trainer/target.py(160): _features", node("benchmarks/tok_s.py(500): train_step"))
    py = node("/opt/torch/.venv/lib/python3.12/site-packages/transformers/models/qwen3_5/modeling_qwen3_5.py(610): "
              "forward", node("/opt/torch/.venv/lib/python3.12/site-packages/torch/nn/modules/module.py(1789): "
                              "_call_impl", py))
    method = node("<built-in method contiguous of Tensor object at 0x7f>", py)
    contig = node("aten::contiguous", method, shapes=[[1, 3072, 32, 128], []])
    clone = node("aten::clone", contig, shapes=[[1, 3072, 32, 128], []])
    copy = node("aten::copy_", clone, shapes=[[1, 3072, 32, 128], [1, 3072, 32, 128], []])
    launch = node("cudaLaunchKernel", copy, kernels=[k("void at::native::elementwise_kernel<direct_copy_kernel>", 3000)])
    bwd = node("aten::add", node("autograd::engine::evaluate_function: AddBackward0"), shapes=[[8], [8]])
    bwd_launch = node("cudaLaunchKernel", bwd, kernels=[k("vectorized_elementwise_kernel<CUDAFunctor_add>", 100)])
    gemm = node("cudaLaunchKernel", node("aten::mm", py), kernels=[k("nvjet_sm90_tst_192x192", 9000)])
    events = [launch, bwd_launch, gemm]
    rows = tok_s.kernel_sources(events, 2, 0.5)
    assert len(rows) == 1, rows  # the add (0.05 ms per step) is under the threshold; the GEMM is not traced
    ms, cat, kname, op, shapes, caller = rows[0]
    assert (ms, cat, op) == (1.5, "copies/casts", "aten::contiguous") and "3072" in shapes
    assert caller == "modeling_qwen3_5.py(610): forward < target.py(160): _features < tok_s.py(500): train_step"
    assert [(r[3], r[5]) for r in tok_s.kernel_sources(events, 2, 0.01)][1] == ("aten::add", "AddBackward0")


def test_kernel_sources_on_a_real_cpu_profile():
    """The parent chain of a real profile (CPU, no kernels launched): the op and caller of an event."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(64, 32).t()

    def make_contiguous():
        return x.contiguous()
    with profile(activities=[ProfilerActivity.CPU], **tok_s.profiler_options(True)) as prof:
        make_contiguous()
    copy = next(e for e in prof.events() if e.name == "aten::copy_")
    launch = type("Launch", (), {"name": "cudaLaunchKernel", "cpu_parent": copy})()
    op, shapes, caller = tok_s._caller(launch)
    assert op == "aten::contiguous" and shapes.startswith("[[32, 64]")
    assert caller.split(" < ")[0].endswith(": make_contiguous"), caller
    # the op's own recorded stack names the caller too: the fallback where no Python events sit above it
    contiguous = next(e for e in prof.events() if e.name == "aten::contiguous")
    assert any(f.endswith(": make_contiguous") for f in contiguous.stack), contiguous.stack
    bare = type("Op", (), {"name": "aten::contiguous", "cpu_parent": None, "input_shapes": [[32, 64]],
                           "stack": contiguous.stack})()
    assert tok_s._source(bare, "?")[2].split(" < ")[0].endswith(": make_contiguous")
    assert tok_s.profiler_options(False) == {"record_shapes": False, "with_stack": False}


def test_table_shows_the_gpu_idle_time_of_profiled_rows():
    rows = [{"preset": "real", "group": "(a) dflash_kernels", "tok_s": 18000.0, "ms_step": 168.6,
             "device_idle_ms": 22.7},
            {"preset": "real", "group": "(b) peers", "tok_s": 12000.0, "ms_step": 250.2}]
    lines = tok_s.format_table(rows).splitlines()
    col = lines[0].split(" | ").index("GPU idle ms")
    assert lines[2].split(" | ")[col].strip() == "22.7" and lines[3].split(" | ")[col].strip() == "-"


def _rows(**extra):
    base = dict(preset="tiny", tok_s=100.0, ms_step=1280.0, model_TFLOP_step=0.001, mfu=1e-6, peak_GiB=float("nan"),
                reserved_GiB=float("nan"), first_step_s=2.0, mask_ms=float("nan"), loss_step1=6.3,
                backends="attn=reference")
    return [{**base, "group": "(a) dflash_kernels", "a_over_this": 1.0, **extra},
            {**base, "group": "(c) reference", "tok_s": 50.0, "a_over_this": 2.0, **extra},
            {"preset": "tiny", "group": "(b) peers", "skipped": "peers run on CUDA only"}]


def test_a_cpu_table_shows_only_the_columns_that_mean_something_there():
    text = tok_s.format_table(_rows(), gpu=False)
    lines = text.splitlines()
    header = [c.strip() for c in lines[0].split("|")]
    assert header == ["preset", "group", "tokens/s", "ms/step", "1st step s", "loss@1", "a / this", "backends"]
    assert lines[3].split("|")[6].strip() == "2.00x"
    legend = lines[lines.index("columns:") + 1:]
    assert [s.split(":")[0].strip() for s in legend] == ["tokens/s", "ms/step", "1st step s", "loss@1", "a / this"]
    assert "MFU" not in text and "TFLOP" not in text and "GPU idle" not in text


def test_a_gpu_table_explains_its_gpu_columns():
    rows = _rows(peak_GiB=1.5, reserved_GiB=2.0, mask_ms=3.0, device_idle_ms=4.0, mfu=0.25)
    text = tok_s.format_table(rows, gpu=True)
    header = [c.strip() for c in text.splitlines()[0].split("|")]
    for col in ("TFLOP/step", "MFU", "peak GiB", "reserved GiB", "mask ms", "GPU idle ms", "a / this"):
        assert col in header, header
    assert "  MFU: model FLOPs / time / 989 TFLOP/s" in text and "  GPU idle ms: " in text
    assert "  mask ms: (b)'s flex BlockMask build per step" in text
    assert "GPU idle ms" not in tok_s.format_table(_rows(), gpu=True)  # no profiled row: no column


def test_rows_print_their_record_only_when_verbose(monkeypatch):
    """Each finished row prints one line with its speed; ``--verbose`` prints its whole record instead."""
    row = {"preset": "tiny", "group": "(a) dflash_kernels", "tok_s": 1234.5, "ms_step": 12.25, "first_step_s": 3.0}
    monkeypatch.setitem(tok_s.SETUPS, "tiny", lambda *a: types.SimpleNamespace(
        cfg=types.SimpleNamespace(batch_size=2, max_len=64, num_anchors=4, num_layers=2, num_heads=2, head_dim=64),
        note="x", name="tiny"))
    monkeypatch.setattr(tok_s, "run_group", lambda *a: dict(row))
    for verbose, expect in ((False, "    (a) dflash_kernels: 1,234 tokens/s, 12.2 ms/step (first step 3.0s)"),
                            (True, "    {'preset': 'tiny'")):
        logged = []
        args = tok_s.parse_args(["--groups", "a", "--device", "cpu"] + (["--verbose"] if verbose else []))
        tok_s.run_preset("tiny", args, torch.device("cpu"), torch.float32, logged.append)
        assert any(s.startswith(expect) for s in logged), logged
        assert any(s.startswith("  tiny (a): 1 warm-up step(s), the shape pass, then 2 timed") for s in logged)
        assert verbose == any("{'preset'" in s for s in logged)


def test_the_help_fits_a_screen(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        tok_s.parse_args(["--help"])
    out = capsys.readouterr().out
    assert len(out.splitlines()) <= 40, out
    assert "--verbose" in out and "what runs:" in out


def test_no_dated_history_in_the_module_docstring():
    import re

    assert not re.search(r"\b20\d\d-\d\d-\d\d\b|\d\d:\d\d\b", tok_s.__doc__)


def test_the_tiny_preset_builds_the_trainers_random_target():
    """One construction for the random targets: tok_s's presets and the trainer's tiny preset share it."""
    import trainer.random_target as random_target

    assert tok_s.TEXT_CONFIGS is random_target.TEXT_CONFIGS
    assert tok_s._random_qwen35_target is random_target.random_qwen35_target
    assert tok_s._synthetic_dataset is random_target.synthetic_dataset
    logged = []
    setup = tok_s.setup_tiny(tok_s.parse_args(["--device", "cpu"]), torch.device("cpu"), torch.float32, logged.append)
    assert logged == ["tok_s: building a random tiny Qwen3.5 target on cpu ..."]
    assert setup.target.model.config.hidden_size == random_target.TEXT_CONFIGS["tiny"]["hidden_size"]


def test_b_plus_is_the_fastest_measured_peer_row():
    """The combination of the pieces that helped is not always faster than one piece alone (the rows below):
    (b+) is the fastest row, whichever it is."""
    rows = [dict(group="(b) peers", ms_step=239.4), dict(group="(b+) cce", ms_step=214.9),
            dict(group="(b+) liger-ew", ms_step=191.8), dict(group="(b+) liger", error="x"),
            dict(group="(b+) cce+liger-ew", ms_step=229.0, b_plus_best=True)]
    assert tok_s.mark_b_plus_best(rows)["group"] == "(b+) liger-ew"
    assert [r["group"] for r in rows if r.get("b_plus_best")] == ["(b+) liger-ew"]
    slow = [dict(group="(b) peers", ms_step=200.0), dict(group="(b+) cce", ms_step=210.0)]
    assert tok_s.mark_b_plus_best(slow)["group"] == "(b) peers"  # no piece helped: (b) is (b+)
    assert tok_s.mark_b_plus_best([dict(group="(b) peers", error="x")]) is None


@pytest.mark.slow
def test_isolated_groups_run_in_processes_of_their_own(tmp_path):
    """--isolate on (the GPU default): one child process per group, the same rows as in one process."""
    out_json = tmp_path / "rows.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "tok_s.py"), "--device", "cpu",
                           "--groups", "a,c", "--steps", "1", "--warmup", "0", "--isolate", "on",
                           "--json", str(out_json)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("== preset tiny") == 2, proc.stdout  # each child builds its own setup
    import json
    recs = {r["group"]: r for r in json.loads(out_json.read_text())["rows"]}
    a, c = recs["(a) dflash_kernels"], recs["(c) reference"]
    assert abs(a["loss_step1"] - c["loss_step1"]) < 1e-3 * abs(c["loss_step1"])  # same seed, model and batch
    assert c["a_over_this"] == pytest.approx(a["tok_s"] / c["tok_s"])
    assert a["target_graphs"] is False and c["target_graphs"] is False  # "auto" on a CPU: the eager forward


def test_a_child_that_dies_is_an_error_row(monkeypatch):
    import types

    cmds = []
    monkeypatch.setattr(tok_s.subprocess, "run",
                        lambda cmd, **k: cmds.append(cmd) or types.SimpleNamespace(returncode=-9))
    args = tok_s.parse_args(["--groups", "a,b", "--device", "cpu", "--warmup", "0", "--trace", "tr",
                             "--target-graphs", "off", "--verbose"])
    logged = []
    rows = tok_s.run_preset_isolated("tiny", args, torch.device("cpu"), logged.append)
    assert [r["group"] for r in rows] == ["(a) dflash_kernels", "(b) peers"]
    assert all("exited with status -9" in r["error"] for r in rows), rows
    assert [c[c.index("--child-group") + 1] for c in cmds] == ["a", "b"]
    assert cmds[0][cmds[0].index("--warmup") + 1] == "0"  # a zero is a value, passed on
    assert cmds[0][cmds[0].index("--trace") + 1] == os.path.abspath("tr")  # the children run in ROOT
    assert cmds[1][cmds[1].index("--target-graphs") + 1] == "off"
    assert "--verbose" in cmds[0] and "--no-build" not in cmds[0]  # the children print what the parent would


def test_run_groups_forms_b_plus_from_the_pieces_that_helped():
    ms = {"a": 140.0, "b": 240.0, "b+liger": 250.0, "b+cce": 215.0, "b+liger-ew": 190.0, "b+cce+liger-ew": 230.0}
    ran = []

    def one(g):
        ran.append(g)
        label = {"a": "(a) dflash_kernels", "b": "(b) peers"}.get(g, f"(b+) {g[2:]}")
        return dict(group=label, ms_step=ms[g], tok_s=1e6 / ms[g])

    rows = tok_s.run_groups(["a", "b", "b+"], one, print)
    assert ran == ["a", "b", "b+liger", "b+cce", "b+liger-ew", "b+cce+liger-ew"]  # the helpful pieces together last
    assert [r["group"] for r in rows if r.get("b_plus_best")] == ["(b+) liger-ew"]
    assert rows[1]["a_over_this"] == pytest.approx(240.0 / 140.0)
    assert tok_s.run_groups(["a", "c"], lambda g: None, print) == []  # a preset that skips itself: no rows


def test_groups_n_and_bn_are_a_and_b_with_the_target_forward_eager():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for base, eager in (("a", "n"), ("b", "bn")):
        p, e = tok_s.group_plan(base, cuda), tok_s.group_plan(eager, cuda)
        assert e["target_graphs"] is False and "target_graphs" not in p  # (a), (b): the trainer's default
        assert {k: v for k, v in e.items() if k not in ("label", "target_graphs")} == {
            k: v for k, v in p.items() if k != "label"}
    assert "skip" in tok_s.group_plan("bn", cpu) and "skip" not in tok_s.group_plan("n", cpu)
    for gone in ("g", "bg"):  # the graphs are the default now: no group turns them on
        with pytest.raises(SystemExit, match=f"unknown group '{gone}'"):
            tok_s.parse_groups(f"a,{gone}")


def test_plus_picks_the_b_plus_variants():
    ran = []

    def one(g):
        ran.append(g)
        return dict(group="(b) peers" if g == "b" else f"(b+) {g[2:]}",
                    ms_step={"b": 240.0, "b+cce": 215.0, "b+liger-ew": 190.0}.get(g, 230.0), tok_s=1.0)

    tok_s.run_groups(["b", "b+"], one, print, plus_variants=tok_s.parse_plus("cce,liger-ew"))
    assert ran == ["b", "b+cce", "b+liger-ew", "b+cce+liger-ew"]
    assert tok_s.parse_plus("") == tok_s.PLUS_VARIANTS
    with pytest.raises(SystemExit, match="--plus: unknown"):
        tok_s.parse_args(["--plus", "cce,flce"])


def test_the_gdn_layer_route_follows_the_target_graphs(monkeypatch):
    """(a) routes the GDN layers where its target runs as CUDA graphs (the trainer's rule), not where it runs
    eagerly ((n)); (r) is (a) without the route; run_group undoes the routing after each row."""
    cuda = torch.device("cuda")
    a, r = tok_s.group_plan("a", cuda), tok_s.group_plan("r", cuda)
    assert r["gdn_layers"] is False and a.get("gdn_layers") is None
    assert {k: v for k, v in r.items() if k not in ("label", "gdn_layers")} == {
        k: v for k, v in a.items() if k != "label"}
    import dflash_kernels.integrations.transformers as integ
    from trainer.config import preset

    calls, undone = [], []

    class Routing:
        def undo(self):
            undone.append(1)

    monkeypatch.setattr(integ, "use_dflash_kernels", lambda model, **kw: calls.append(kw) or Routing())
    monkeypatch.setattr(tok_s, "_run_group", lambda *a, **k: {"group": "x"})
    setup = tok_s.Setup("tiny", preset("tiny"), type("T", (), {"model": None})(), None, "")
    rows = [tok_s.run_group(setup, g, 1, 0, cuda, torch.bfloat16) for g in ("a", "n", "r")]
    assert [c["gdn_layers"] for c in calls] == [True, False, False] and undone == [1, 1, 1]
    assert [row["gdn_layers"] for row in rows] == [True, False, False]
    assert all(c["elementwise"] for c in calls)


def test_groups_w_and_bw_step_eagerly():
    cuda = torch.device("cuda")
    """(a) and (b) follow the trainer's default (graphs where it says so); (w) and (bw) step eagerly."""
    assert tok_s.group_plan("w", cuda)["step_graphs"] is False and tok_s.group_plan("a", cuda).get("step_graphs") is None
    assert "skip" in tok_s.group_plan("w", torch.device("cpu"))
    bw = tok_s.group_plan("bw", cuda)
    if "skip" not in bw:  # the peers are importable (a GPU machine)
        assert bw["step_graphs"] is False and bw["flex"]


def test_groups_k_and_m_set_the_compute_weights():
    """(a) follows the trainer's compute_weights="auto" (bf16 copies on a GPU in bf16); (k) is (a) with
    autocast's casts, (m) with the copies asked for explicitly; nothing else differs."""
    cuda = torch.device("cuda")
    a, k, m = (tok_s.group_plan(g, cuda) for g in ("a", "k", "m"))
    assert (a["adamw"], k["adamw"], m["adamw"]) == ("auto", "fused", "copies")
    for plan in (k, m):
        assert {key: v for key, v in plan.items() if key not in ("label", "adamw")} == \
            {key: v for key, v in a.items() if key not in ("label", "adamw")}


def test_group_s_sets_the_split_gdn_forward_for_its_row_only(monkeypatch):
    """(s) is (a) with DFLASH_KERNELS_GDN_FWD_SPLIT=1 while its row runs (the library reads it at each
    call), restored after the row, also when the row fails; (f) with =0; (a) leaves the library's pick."""
    import os

    import dflash_kernels.integrations.transformers as integ
    from dflash_kernels.runtime import settings

    cuda = torch.device("cuda")
    a, s = tok_s.group_plan("a", cuda), tok_s.group_plan("s", cuda)
    assert {k: v for k, v in s.items() if k not in ("label", "env")} == {k: v for k, v in a.items() if k != "label"}
    monkeypatch.delenv("DFLASH_KERNELS_GDN_FWD_SPLIT", raising=False)
    monkeypatch.setattr(integ, "use_dflash_kernels", lambda model, **kw: type("R", (), {"undo": lambda self: None})())
    seen = []

    def fake_run_group(*args, **kwargs):
        seen.append(settings.gdn_fwd_split())
        if len(seen) == 2:
            raise RuntimeError("boom")
        return {"group": "x"}
    monkeypatch.setattr(tok_s, "_run_group", fake_run_group)
    from trainer.config import preset

    setup = tok_s.Setup("tiny", preset("tiny"), type("T", (), {"model": None})(), None, "")
    tok_s.run_group(setup, "s", 1, 0, cuda, torch.bfloat16)
    with pytest.raises(RuntimeError, match="boom"):
        tok_s.run_group(setup, "s", 1, 0, cuda, torch.bfloat16)
    tok_s.run_group(setup, "a", 1, 0, cuda, torch.bfloat16)
    tok_s.run_group(setup, "f", 1, 0, cuda, torch.bfloat16)
    assert seen == [True, True, None, False] and "DFLASH_KERNELS_GDN_FWD_SPLIT" not in os.environ
    f = tok_s.group_plan("f", cuda)
    assert f["env"] == {"DFLASH_KERNELS_GDN_FWD_SPLIT": "0"}
    assert {k: v for k, v in f.items() if k not in ("label", "env")} == {k: v for k, v in a.items() if k != "label"}


@pytest.mark.parametrize("shape_pass", [True, False])
def test_shape_pass_runs_every_timed_batch_before_the_clock(monkeypatch, shape_pass):
    """Every timed batch's forward and backward run once before the clock starts (no update), so first-time
    compilation and tuning of its shapes are not timed; ``--shape-pass off`` times the steps as they come."""
    import trainer.step as step
    import trainer.step_graph as step_graph

    calls, clock = [], []
    real_loss = step.drafter_loss

    def drafter_loss(batch, *a, **k):  # the drafter's forward of the shape pass and of every step
        calls.append(batch["input_ids"].clone())
        return real_loss(batch, *a, **k)
    monkeypatch.setattr(step, "drafter_loss", drafter_loss)
    monkeypatch.setattr(step_graph, "drafter_loss", drafter_loss)
    real_sync = tok_s._sync
    monkeypatch.setattr(tok_s, "_sync", lambda dev: clock.append(len(calls)) or real_sync(dev))
    monkeypatch.setitem(tok_s.TIMING, "shape_pass", shape_pass)
    args = tok_s.parse_args(["--device", "cpu"])
    dev = torch.device("cpu")
    setup = tok_s.setup_tiny(args, dev, torch.float32, lambda *a: None)
    warmup, steps = 1, 2
    import dflash_kernels as dk
    ops = sorted(tok_s.group_plan("c", dev)["backends"])
    before = {op: dk.get_backend(op) for op in ops}
    row = tok_s.run_group(setup, "c", steps, warmup, dev, torch.float32)
    assert {op: dk.get_backend(op) for op in ops} == before  # (c)'s reference backends set for its row only
    assert row["shape_pass"] is shape_pass and row["tok_s"] > 0
    assert len(calls) == warmup + steps * (2 if shape_pass else 1), len(calls)
    timed = calls[-steps:]
    before_clock = calls[:clock[-2]]  # _sync: after step 1's loss, at the clock's start, at its end
    seen = [any(torch.equal(t, b) for b in before_clock) for t in timed]
    assert seen == [shape_pass] * steps


def test_caller_falls_back_to_the_ops_recorded_stack():
    """Where the profile has no Python events above the op, its own recorded ``stack`` names the caller
    (torch frames left out)."""
    from types import SimpleNamespace as E

    op = E(name="aten::repeat_interleave", cpu_parent=E(name="<built-in method repeat_interleave>", cpu_parent=None),
           input_shapes=[[1, 3072, 16, 128], [], [], []],
           stack=["/x/site-packages/torch/nn/modules/module.py(1789): _call_impl",
                  "/x/site-packages/transformers/models/qwen3_5/modeling_qwen3_5.py(420): forward",
                  "/work/trainer/target.py(160): _features"])
    launch = E(name="cudaLaunchKernel", cpu_parent=op)
    assert tok_s._caller(launch) == ("aten::repeat_interleave", "[[1, 3072, 16, 128], [], [], []]",
                                     "modeling_qwen3_5.py(420): forward < target.py(160): _features")


def test_idle_sources_attribute_each_gap_to_what_the_host_was_running():
    """The GPU's idle gaps (every stream's kernels merged, user-annotation ranges left out) go to the host
    event running at the gap's middle, the most recently started one: a host sync's op, a Python mask
    build; time the GPU is busy on any stream is no gap."""
    from types import SimpleNamespace as E
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def ev(name, dtype, start, end, parent=None, shapes=(), **kw):
        return E(name=name, device_type=dtype, time_range=E(start=start, end=end), cpu_parent=parent,
                 input_shapes=list(shapes), device_time_total=float(end - start) if dtype == cuda else 0.0, **kw)

    step = ev("trainer/step.py(50): drafter_loss", cpu, 0, 2000)
    nonzero = ev("aten::nonzero", cpu, 200, 310, step, shapes=[[8, 64]])
    masks = ev("benchmarks/peers.py(70): masks", cpu, 400, 1000, step)
    early = ev("aten::lt", cpu, 400, 420, masks)  # started with the mask build, over before the gap's middle
    events = [step, nonzero, masks, early,
              ev("k1", cuda, 0, 100), ev("k2", cuda, 90, 200),  # two streams: one busy interval
              ev("k3", cuda, 300, 400), ev("k4", cuda, 1000, 1100),
              ev("range", cuda, 0, 1100, is_user_annotation=True)]
    idle, rows = tok_s.idle_sources(events, 1, 0.0)
    assert idle == pytest.approx(0.7)
    assert [(round(ms, 6), gaps, op) for ms, gaps, op, shapes, caller in rows] == [
        (0.6, 1.0, "benchmarks/peers.py(70): masks"), (0.1, 1.0, "aten::nonzero")]
    assert rows[0][4] == "peers.py(70): masks < step.py(50): drafter_loss"
    assert rows[1][3] == "[[8, 64]]" and rows[1][4] == "step.py(50): drafter_loss"
    idle2, rows2 = tok_s.idle_sources(events, 2, 0.2)  # per step over 2 steps, a threshold
    assert idle2 == pytest.approx(0.35) and [r[2] for r in rows2] == ["benchmarks/peers.py(70): masks"]


def test_idle_sources_of_a_profile_without_kernels_is_empty():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        torch.randn(64, 32).t().contiguous()
    assert tok_s.idle_sources(prof.events(), 1, 0.0) == (0.0, [])


@pytest.mark.parametrize("device", [
    pytest.param("cpu", id="cpu-aot_eager"), pytest.param("cuda", id="cuda-inductor", marks=pytest.mark.gpu)])
def test_flex_peer_compiled_masks_match_the_eager_build(device):
    """(b)'s masks come from ``torch.compile(create_block_mask)``: the same BlockMask as the eager build,
    step after step with new anchors, valid flags and context lengths read from its buffers. On the CPU
    through the ``aot_eager`` backend (dynamo's tracing and guards; inductor's CPU code for this mask does
    not compile with torch 2.13: "operands to ?: have different types"), on the GPU through inductor."""
    from trainer.model import DFlashDrafter, DrafterConfig

    cfg = DrafterConfig(hidden_size=64, intermediate_size=96, vocab_size=100, num_layers=2, num_heads=2,
                        num_kv_heads=1, head_dim=64, block_size=4, target_layer_ids=[0, 1],
                        layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    opts = {"backend": "aot_eager"} if device == "cpu" else None
    compiled = tok_s.FlexDrafterAttention(DFlashDrafter(cfg), compiled=True, compile_options=opts)
    eager = tok_s.FlexDrafterAttention(DFlashDrafter(cfg), compiled=False)
    steps = [(torch.tensor([[2, 9, 15], [0, 7, 17]]), 21, torch.tensor([[True, True, True], [True, False, True]])),
             (torch.tensor([[5, 1, 20], [3, 3, 30]]), 33, None),
             (torch.tensor([[0, 4, 8], [1, 2, 3]]), 12, torch.tensor([[False, True, True], [True, True, False]]))]
    for anchors, S, valid in steps:
        anchors, valid = anchors.to(device), valid if valid is None else valid.to(device)
        got, want = compiled.masks(anchors, S, valid), eager.masks(anchors, S, valid)
        assert set(got) == set(want) == {"sliding_attention", "full_attention"}
        for t in want:
            assert torch.equal(got[t].to_dense(), want[t].to_dense()), (t, S)
            assert got[t].seq_lengths == want[t].seq_lengths == (12, S + 12)
    assert compiled.create_block_mask is not eager.create_block_mask and compiled.mask_s > 0


def test_step_spans_split_the_timed_steps(monkeypatch):
    """The CUDA-event split of the timed steps, on fake events with set times: warm-up marks before the first
    start are ignored; target, drafter and between are means over the timed steps."""
    now = [0.0]

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = now[0]

        def elapsed_time(self, other):
            return other.t - self.t

    monkeypatch.setattr(tok_s.torch.cuda, "Event", FakeEvent)
    spans = tok_s.StepSpans(torch.device("cuda"))
    assert spans.on
    for name, t in [("target", 1), ("drafter", 2),  # a warm-up step: no start yet
                    ("start", 10), ("target", 20), ("drafter", 50),
                    ("start", 53), ("target", 61), ("drafter", 95)]:
        now[0] = t
        spans.mark(name)
    assert spans.split() == {"target": 9.0, "drafter": 32.0, "between": 3.0}
    assert tok_s.StepSpans(torch.device("cpu")).split() == {}  # off the GPU: nothing recorded
    off = tok_s.StepSpans(torch.device("cpu"))
    off.mark("start")
    assert off.steps == []
