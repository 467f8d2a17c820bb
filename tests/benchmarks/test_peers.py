"""benchmarks/peers.py: which peers the tok_s peers group (b) finds, and what it says about the missing ones."""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import peers  # noqa: E402
import tok_s  # noqa: E402


def test_peer_importable(tmp_path, monkeypatch):
    assert peers.peer_importable("json")
    assert not peers.peer_importable("no_such_peer_module")
    (tmp_path / "broken_peer.py").write_text("raise OSError('libcuda.so.1: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not peers.peer_importable("broken_peer")  # a broken install counts as missing, not as a crash


def test_peer_backends_fall_back_to_the_library_with_a_note(monkeypatch):
    monkeypatch.setattr(peers, "peer_importable", lambda m: m == "causal_conv1d")
    back, notes = peers.peer_backends()
    assert back == {"attention": "auto", "gdn": "auto", "conv1d": "causal_conv1d"}
    assert notes == ["fla not importable: the target's GDN stays on dflash_kernels"]
    monkeypatch.setattr(peers, "peer_importable", lambda m: True)
    assert peers.peer_backends() == ({"attention": "auto", "gdn": "fla", "conv1d": "causal_conv1d"}, [])


def test_tok_s_peers_group_uses_them(monkeypatch):
    monkeypatch.setattr(peers, "peer_importable", lambda m: False)
    plan = tok_s.group_plan("b", torch.device("cuda"))
    assert plan["flex"] and plan["backends"]["gdn"] == "auto" and "causal-conv1d not importable" in plan["note"]
    assert "skip" in tok_s.group_plan("b", torch.device("cpu"))
    assert tok_s.FlexDrafterAttention is peers.FlexDrafterAttention


# ------------------------------------------------------------------------------------- (b+)
def test_b_plus_groups_parse_and_plan(monkeypatch):
    assert tok_s.parse_groups("a, b,b+") == ["a", "b", "b+"]
    for bad, msg in (("b+,b", "put b before b+"), ("a,b+", "put b before b+"), ("a,x", "unknown group 'x'")):
        with pytest.raises(SystemExit, match=msg):
            tok_s.parse_groups(bad)
    monkeypatch.setattr(peers, "peer_importable", lambda m: True)
    cuda = torch.device("cuda")
    plan = tok_s.group_plan("b+liger", cuda)
    assert plan["label"] == "(b+) liger" and plan["peer_loss"] == "liger" and plan["loss"] == "chunked"
    assert not plan["liger_elementwise"] and plan["flex"]
    plan = tok_s.group_plan("b+cce+liger-ew", cuda)
    assert plan["peer_loss"] == "cce" and plan["liger_elementwise"] and plan["label"] == "(b+) cce+liger-ew"
    plan = tok_s.group_plan("b+liger-ew", cuda)
    assert plan["peer_loss"] is None and plan["liger_elementwise"] and plan["loss"] == "logits"
    with pytest.raises(SystemExit, match="unknown"):
        tok_s.group_plan("b+flce", cuda)
    assert "skip" in tok_s.group_plan("b+liger", torch.device("cpu"))
    with pytest.raises(ValueError, match="name: unknown peer loss 'x'"):
        peers.peer_head_loss("x")


def test_undo_restores_instance_patches_and_module_globals():
    import types

    lin = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)
    ref = lin(x)
    holder = types.SimpleNamespace(value=1)
    undo = peers._Undo([lin], [(holder, "value")])
    lin.forward = types.MethodType(lambda self, x: x * 0, lin)
    lin.extra = 5
    holder.value = 2
    assert lin(x).abs().sum() == 0
    undo.undo()
    assert torch.equal(lin(x), ref) and not hasattr(lin, "extra") and holder.value == 1
    assert "forward" not in lin.__dict__


def _gpu_peer(module):
    if not torch.cuda.is_available():
        pytest.skip("the peers' Triton kernels run on CUDA only (not under the interpreter)")
    pytest.importorskip(module)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["liger", "cce"])
def test_peer_head_loss_is_the_dflash_loss(name):
    """The (b+) loss rows compute the trainer's weighted CE: loss and hidden gradient against the fp32
    logits path (``dflash_loss``), at the real vocabulary and an odd row count."""
    _gpu_peer({"liger": "liger_kernel", "cce": "cut_cross_entropy"}[name])
    from tests.helpers import rel_err
    from trainer.loss import dflash_loss

    torch.manual_seed(0)
    B, N, bs, H, V = 1, 37, 16, 256, 248320
    hidden = (torch.randn(B, N * bs, H, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_(True)
    W = (torch.randn(V, H, device="cuda") * 0.05).to(torch.bfloat16)
    labels = torch.randint(0, V, (B, N, bs), device="cuda")
    counted = torch.rand(B, N, bs, device="cuda") > 0.3
    counted[:, :, 0] = False
    ref, ref_stats = dflash_loss(hidden.float() @ W.float().T, labels, counted, 7.0)
    (g_ref,) = torch.autograd.grad(ref, hidden)
    loss, stats = peers.peer_head_loss(name)(hidden, W, labels, counted, 7.0)
    (g,) = torch.autograd.grad(loss, hidden)
    assert abs(loss.item() - ref.item()) / ref.item() < 2e-2
    assert rel_err(g.float(), g_ref.float()) < 3e-2
    if name == "liger":
        assert stats["acc"] == pytest.approx(ref_stats["acc"], abs=0.02)


@pytest.mark.gpu
@pytest.mark.parametrize("piece", ["rope", "rms_norm", "swiglu"])
def test_liger_piece_matches_the_drafters_eager_chain(piece):
    """Each Liger piece the (b+) liger-ew rows swap in, alone against the drafter's eager chain in fp32
    (output and every input gradient; RoPE with two sequences at different positions, as the drafter's
    per-batch tables): narrows a mismatch of the whole drafter below to one piece."""
    _gpu_peer("liger_kernel")
    from tests.helpers import rel_err
    import trainer.model as tm

    torch.manual_seed(0)
    B, T, H, D = 2, 37, 4, 64
    if piece == "rope":
        from liger_kernel.transformers.functional import liger_rope
        q = torch.randn(B, T, H, D, device="cuda", requires_grad=True)
        k = torch.randn(B, T, 2, D, device="cuda", requires_grad=True)
        pos = torch.stack([torch.arange(T), torch.arange(T) + 100]).cuda()
        cos, sin = tm.rope_cos_sin(pos, D, 10000.0)
        ref = (tm.apply_rope(q, cos, sin), tm.apply_rope(k, cos, sin))
        lq, lk = liger_rope(q.clone().transpose(1, 2), k.clone().transpose(1, 2), cos[:, :, 0], sin[:, :, 0])
        got = (lq.transpose(1, 2), lk.transpose(1, 2))
        inputs = (q, k)
    elif piece == "rms_norm":
        from liger_kernel.transformers.functional import liger_rms_norm
        x = torch.randn(B, T, H, D, device="cuda", requires_grad=True)
        norm = tm.RMSNorm(D, 1e-6).cuda()
        with torch.no_grad():
            norm.weight.add_(0.3 * torch.randn_like(norm.weight))
        ref = (norm(x),)
        got = (liger_rms_norm(x, norm.weight, 1e-6, 0.0, casting_mode="gemma", in_place=False),)
        inputs = (x, norm.weight)
    else:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        a = torch.randn(B * T, 96, device="cuda", requires_grad=True)
        b = torch.randn(B * T, 96, device="cuda", requires_grad=True)
        ref, got, inputs = (tm.swiglu(a, b),), (LigerSiLUMulFunction.apply(a, b),), (a, b)
    dys = [torch.randn_like(r) for r in ref]
    g_ref = torch.autograd.grad(ref, inputs, dys)
    g_got = torch.autograd.grad(got, inputs, dys)
    for r, o in zip(ref, got):
        assert rel_err(o, r) < 1e-5
    for i, (r, o) in enumerate(zip(g_ref, g_got)):
        assert rel_err(o, r) < 1e-5, f"{piece}: gradient of input {i}: rel {rel_err(o, r):.3g}"


@pytest.mark.gpu
def test_liger_elementwise_drafter_and_target_then_undone():
    """Liger's norm / RoPE / SwiGLU give the eager drafter's and target's outputs and gradients; the undo
    brings back the eager modules exactly. The gradients are of a fixed random projection of the output:
    with ``out.square().sum()``, nearly constant after the final RMSNorm, they would be mostly cancellation,
    and a bf16-rounding-sized perturbation of the queries would move them as much as Liger's RoPE does; with
    the projection Liger's RoPE differs by bf16 rounding only."""
    _gpu_peer("liger_kernel")
    from tests.helpers import rel_err
    from trainer.model import DFlashDrafter, DrafterConfig
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=256, intermediate_size=384, vocab_size=100, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=64, block_size=4, target_layer_ids=[0, 1],
                        layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    drafter = DFlashDrafter(cfg).cuda()
    target = Qwen3_5ForCausalLM(Qwen3_5TextConfig(
        vocab_size=128, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, layer_types=["linear_attention", "full_attention"])).cuda()
    B, S, N = 2, 45, 3
    anchors = torch.tensor([[2, 9, 30], [0, 7, 40]], device="cuda")
    valid = torch.ones(B, N, dtype=torch.bool, device="cuda")
    emb = torch.randn(B, N * 4, 256, device="cuda")
    feats = torch.randn(B, S, 512, device="cuda")
    ids = torch.randint(0, 128, (B, S), device="cuda")

    def run():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = drafter(emb, feats, anchors, valid)
            proj = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).cuda()
            grads = torch.autograd.grad((out.float() * proj).sum(), list(drafter.parameters()))
            with torch.no_grad():
                t = target(ids).logits
        return out.float(), grads, t.float()

    ref = run()
    undo = peers.liger_elementwise(drafter, target)
    got = run()
    assert rel_err(got[0], ref[0]) < 2e-2 and rel_err(got[2], ref[2]) < 2e-2
    errs = {n: rel_err(a.float(), b.float()) for (n, _), a, b in zip(drafter.named_parameters(), got[1], ref[1])}
    print("liger vs eager, parameter gradients (relative):", {n: f"{e:.3g}" for n, e in errs.items()})
    assert max(errs.values()) < 5e-2, max(errs, key=errs.get)  # the library's fused ops' bf16 tolerance
    undo.undo()
    again = run()
    assert torch.equal(again[0], ref[0]) and torch.equal(again[2], ref[2])


def test_plus_rows_patch_for_the_row_only(monkeypatch):
    """A (b+) row swaps the peer loss into the step and Liger's ops into the row's fresh drafter, and
    undoes both after the row, also when it fails."""
    import types

    import trainer.step as step_mod

    original = step_mod.dflash_head_loss
    events = []
    monkeypatch.setattr(tok_s, "peer_head_loss", lambda name: f"peer:{name}")
    monkeypatch.setattr(tok_s, "liger_elementwise", lambda drafter, model: types.SimpleNamespace(
        undo=lambda: events.append(("undo", drafter))))

    def fake_run_group(setup, *args, on_drafter=None):
        events.append(("loss", step_mod.dflash_head_loss))
        on_drafter("drafter")
        if setup.note == "fail":
            raise RuntimeError("boom")
        return {}

    monkeypatch.setattr(tok_s, "_run_group", fake_run_group)
    setup = tok_s.Setup("x", None, types.SimpleNamespace(model=None), None, "")
    plan = {"peer_loss": "liger", "liger_elementwise": True}
    row = tok_s._run_plus_group(plan, setup)
    assert events == [("loss", "peer:liger"), ("undo", "drafter")] and step_mod.dflash_head_loss is original
    assert row == {"elementwise": "liger", "loss_path": "liger"}
    events.clear()
    with pytest.raises(RuntimeError, match="boom"):
        tok_s._run_plus_group(plan, tok_s.Setup("x", None, types.SimpleNamespace(model=None), None, "fail"))
    assert events[-1] == ("undo", "drafter") and step_mod.dflash_head_loss is original
