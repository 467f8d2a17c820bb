"""The peers ``benchmarks/tok_s.py`` times the library against (its group (b)): the drafter's attention
as ``flex_attention`` with a ``create_block_mask`` BlockMask rebuilt every step, and the target's
Gated DeltaNet on fla and short conv on causal-conv1d where those packages import (CUDA only).

Imported by ``tok_s.py`` from the same folder (``benchmarks/`` is on ``sys.path`` when a script
there runs, and the tests put it there).
"""

import time

import torch

__all__ = ["FlexDrafterAttention", "peer_importable", "peer_backends"]


class FlexDrafterAttention:
    """The peer path for the drafter's attention: ``flex_attention`` with ``create_block_mask``.

    Installed on one drafter instance: its ``masks`` method is shadowed by one that builds a flex
    ``BlockMask`` per layer type (the DFlash mask: block i sees context keys ``kv < anchor_i``,
    within the window on sliding layers, and its own block's keys; invalid blocks see nothing), and
    each layer's attention forward is replaced by the same projections, norms and RoPE as
    ``trainer.model.Attention.forward`` followed by flex instead of ``block_sparse_attention``.
    The masks are rebuilt every step, as a trainer must (anchors are resampled every step); the
    mask functions read the anchors from fixed buffers, so ``torch.compile`` sees the same
    ``mask_mod`` every step and does not recompile. ``mask_s`` accumulates the build time.
    """

    def __init__(self, drafter, compiled: bool = True):
        from torch.nn.attention.flex_attention import flex_attention

        self.drafter = drafter
        self.flex = torch.compile(flex_attention) if compiled else flex_attention
        self.mask_s = 0.0
        self.anchors = None
        self.valid = None
        self.mask_mods = {}
        drafter.masks = self.masks
        for layer in drafter.layers:
            layer.self_attn.attend = self._attend_fn()

    def _mask_mod(self, S: int, window):
        bs = self.drafter.config.block_size

        def mask_mod(b, h, q_idx, kv_idx):
            blk = q_idx // bs
            a = self.anchors[b, blk]
            ctx = kv_idx < a
            if window is not None:
                ctx = ctx & (kv_idx >= a - window)
            own = (kv_idx >= S) & ((kv_idx - S) // bs == blk)
            return (ctx | own) & self.valid[b, blk]
        return mask_mod

    def masks(self, anchors, context_len, valid=None):
        from torch.nn.attention.flex_attention import create_block_mask

        cfg = self.drafter.config
        t0 = time.perf_counter()
        if valid is None:
            valid = torch.ones_like(anchors, dtype=torch.bool)
        if self.anchors is None or self.anchors.shape != anchors.shape or self.anchors.device != anchors.device:
            self.anchors, self.valid, self.mask_mods = anchors.clone(), valid.clone(), {}
        self.anchors.copy_(anchors)
        self.valid.copy_(valid)
        B, N = anchors.shape
        Tq = N * cfg.block_size
        out = {}
        for t in set(cfg.layer_types):
            window = cfg.sliding_window if t == "sliding_attention" else None
            key = (context_len, window)
            if key not in self.mask_mods:
                self.mask_mods[key] = self._mask_mod(context_len, window)
            out[t] = create_block_mask(self.mask_mods[key], B, None, Tq, context_len + Tq, device=anchors.device)
        if anchors.device.type == "cuda":
            torch.cuda.synchronize(anchors.device)
        self.mask_s += time.perf_counter() - t0
        return out

    def _attend_fn(self):
        flex = self.flex

        def attend(q, k, v, mask):
            # flex takes [B, H, T, D]; the library's layout is [B, T, H, D].
            o = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask, enable_gqa=True)
            return o.transpose(1, 2)
        return attend


def peer_importable(module: str) -> bool:
    """Whether ``module`` imports: a missing or broken peer install counts as not available."""
    try:
        __import__(module)
        return True
    except Exception:  # noqa: BLE001 - a broken peer install is "not available", with the reason printed
        return False


def peer_backends() -> tuple:
    """``({op: dflash_kernels backend}, [notes])`` for the target's ops in the peers group: ``fla`` /
    ``causal_conv1d`` where importable, else ``auto`` (dflash_kernels) with a note saying so."""
    back = {"attention": "auto"}  # unused: flex replaces the drafter's attention call
    missing = []
    back["gdn"] = "fla" if peer_importable("fla.ops.gated_delta_rule") else "auto"
    back["conv1d"] = "causal_conv1d" if peer_importable("causal_conv1d") else "auto"
    if back["gdn"] == "auto":
        missing.append("fla not importable: the target's GDN stays on dflash_kernels")
    if back["conv1d"] == "auto":
        missing.append("causal-conv1d not importable: the target's conv stays on dflash_kernels")
    return back, missing
