"""benchmarks/peers.py: which peers the tok_s peers group (b) finds, and what it says about the missing ones."""

import os
import sys

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
