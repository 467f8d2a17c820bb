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
    The masks are rebuilt every step, as a trainer must (anchors are resampled every step), by
    ``torch.compile(create_block_mask)`` (with ``compiled``, the default); the mask functions read the
    anchors, valid flags and context length from fixed buffers, so ``torch.compile`` sees the same
    ``mask_mod`` every step and does not recompile. ``mask_s`` accumulates the build's host time (its
    kernels run asynchronously: a synchronization after the build would make this the wait for all
    earlier GPU work plus the build, and put a host synchronization into (b)'s step).
    """

    def __init__(self, drafter, compiled: bool = True, compile_options=None, compiled_mask=None):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        self.drafter = drafter
        # compiled: flex_attention and the mask build both under torch.compile (``compile_options`` its
        # keywords), as torchtitan and NeMo's DFlash masks do and PyTorch recommends for large masks (the
        # eager build materializes the dense [B, Tq, KV] mask: 8192 x 11264 per sequence at the real preset).
        # compiled_mask: the mask build's own choice (default: as ``compiled``).
        opts = compile_options or {}
        compiled_mask = compiled if compiled_mask is None else compiled_mask
        self.flex = torch.compile(flex_attention, **opts) if compiled else flex_attention
        self.create_block_mask = torch.compile(create_block_mask, **opts) if compiled_mask else create_block_mask
        self.mask_s = 0.0
        self.anchors = self.valid = self.context_len = None
        self.mask_mods = {}
        drafter.masks = self.masks
        for layer in drafter.layers:
            layer.self_attn.attend = self._attend_fn()

    def _mask_mod(self, window):
        """The DFlash mask of one layer type; the anchors, valid flags and context length are read from
        buffers refilled every step, so the same function serves every step and length (no recompiles
        for a new context length beyond torch.compile's dynamic-shape one)."""
        bs = self.drafter.config.block_size

        def mask_mod(b, h, q_idx, kv_idx):
            blk = q_idx // bs
            a = self.anchors[b, blk]
            S = self.context_len
            ctx = kv_idx < a
            if window is not None:
                ctx = ctx & (kv_idx >= a - window)
            own = (kv_idx >= S) & ((kv_idx - S) // bs == blk)
            return (ctx | own) & self.valid[b, blk]
        return mask_mod

    def masks(self, anchors, context_len, valid=None):
        cfg = self.drafter.config
        t0 = time.perf_counter()
        if valid is None:
            valid = torch.ones_like(anchors, dtype=torch.bool)
        if self.anchors is None or self.anchors.shape != anchors.shape or self.anchors.device != anchors.device:
            self.anchors, self.valid = anchors.clone(), valid.clone()
            self.context_len = torch.zeros((), dtype=torch.int64, device=anchors.device)
        self.anchors.copy_(anchors)
        self.valid.copy_(valid)
        self.context_len.fill_(context_len)
        B, N = anchors.shape
        Tq = N * cfg.block_size
        out = {}
        for t in set(cfg.layer_types):
            window = cfg.sliding_window if t == "sliding_attention" else None
            if window not in self.mask_mods:
                self.mask_mods[window] = self._mask_mod(window)
            out[t] = self.create_block_mask(self.mask_mods[window], B, None, Tq, context_len + Tq,
                                            device=anchors.device)
        self.mask_s += time.perf_counter() - t0  # host time: no synchronization added to the peer's step
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


# ------------------------------------------------------------------ (b+): Liger Kernel and CCE
PLUS_LOSSES = ("liger", "cce")  # the fused LM-head losses a user could put in (b)'s place


def peer_head_loss(name: str):
    """``dflash_head_loss``'s signature through a peer's fused linear cross-entropy (``name`` in
    :data:`PLUS_LOSSES`): every row it is given goes in, the uncounted ones at ``ignore_index``,
    ``reduction="none"`` gives each row's CE, and the weighted mean ``sum(w * ce) / sum(w)`` is taken
    outside (neither peer takes per-row weights; Liger's backward then recomputes its logits chunks
    to fold the per-row upstream gradient in). Liger returns its argmax for the accuracy; CCE has none,
    so its stats carry ``acc`` NaN (the benchmark reads only the loss)."""
    from trainer.loss import IGNORE_INDEX, _stats, _weights

    if name == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    elif name == "cce":
        from cut_cross_entropy import linear_cross_entropy
    else:
        raise ValueError(f"name: unknown peer loss {name!r}; choose one of {list(PLUS_LOSSES)}")

    def head_loss(hidden, weight, labels, counted, gamma, bias=None, chunk_rows=None, fused=False, first=0):
        B, N, bs = labels.shape
        lab = torch.where(counted, labels, IGNORE_INDEX).reshape(-1)
        w = (_weights(labels, gamma, first, hidden.device)[None, None, :] * counted).reshape(-1)
        h = hidden.reshape(B * N * bs, -1).to(weight.dtype)
        if name == "liger":
            out = liger_fused_linear_cross_entropy(h, weight, lab, bias=bias, ignore_index=IGNORE_INDEX,
                                                   reduction="none", return_predicted_tokens=True)
            ce, pred = out.loss, out.predicted_tokens
        else:
            if bias is not None:
                raise ValueError("cce: the LM head's bias is not supported by this benchmark's CCE path")
            ce, pred = linear_cross_entropy(h, weight, lab, ignore_index=IGNORE_INDEX, reduction="none"), None
        loss = (ce.float() * w).sum() / w.sum().clamp_min(1e-12)
        if pred is None:
            return loss, {"acc": float("nan"), "acc_by_pos": torch.full((bs + first,), float("nan")), "tokens": -1}
        with torch.no_grad():
            hit = (pred.view(B, N, bs) == labels) & counted
        return loss, _stats(hit, counted, first)
    return head_loss


class _Undo:
    """Restores every instance attribute a patch added or replaced on a set of modules, and module
    globals it rebound (Liger patches instances by binding ``forward`` into their ``__dict__``)."""

    def __init__(self, modules, globals_=()):
        self.saved = [(m, dict(m.__dict__)) for m in modules]
        self.globals = [(mod, name, getattr(mod, name)) for mod, name in globals_]

    def undo(self):
        for m, before in self.saved:
            for k in [k for k in m.__dict__ if k not in before]:
                del m.__dict__[k]
            for k, v in before.items():
                if m.__dict__.get(k) is not v:
                    m.__dict__[k] = v
        for mod, name, value in self.globals:
            setattr(mod, name, value)


def liger_elementwise(drafter, target_model) -> _Undo:
    """Liger Kernel's RMSNorm, RoPE and SwiGLU in the drafter and its RMSNorm and SwiGLU MLP in the
    target (``apply_liger_kernel_to_qwen3_5(model=...)``: Liger has no RoPE for Qwen3.5's hybrid
    attention). Returns the undo. Drafter: RMSNorm as ``liger_rms_norm(..., casting_mode="gemma")``
    (fp32 throughout, as the drafter's own), ``liger_rope`` (the attention's ``rotate``) on q and the
    draft keys together (one table) and on the context keys with a one-head stand-in for its second
    tensor, SwiGLU as ``LigerSiLUMulFunction``."""
    import types

    import trainer.model as tm
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    from liger_kernel.transformers.functional import liger_rms_norm, liger_rope
    from liger_kernel.transformers.monkey_patch import apply_liger_kernel_to_qwen3_5
    from transformers.models.qwen3_5 import modeling_qwen3_5

    mods = list(drafter.modules()) + list(target_model.modules())
    undo = _Undo(mods, [(modeling_qwen3_5, "Qwen3_5RMSNorm"), (modeling_qwen3_5, "Qwen3_5MLP"),
                        (modeling_qwen3_5.Qwen3_5ForCausalLM, "forward")])

    def norm_forward(self, x):
        return liger_rms_norm(x, self.weight, self.eps, 0.0, casting_mode="gemma", in_place=False)

    def rope2(q, k, cos, sin):  # [B, T, H, D] and cos / sin [B, T, 1, D] -> Liger's [B, H, T, D], [B, T, D]
        q, k = liger_rope(q.transpose(1, 2), k.transpose(1, 2), cos[:, :, 0], sin[:, :, 0])
        return q.transpose(1, 2), k.transpose(1, 2)

    def rotate(self, q, kx, kc, rope_q, rope_ctx):
        q, kx = rope2(q, kx, *rope_q)
        kc, _ = rope2(kc, kc.new_zeros(kc.shape[0], kc.shape[1], 1, kc.shape[3]), *rope_ctx)
        return q, kx, kc

    def mlp_forward(self, x):
        return self.down_proj(LigerSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))

    for m in drafter.modules():
        if isinstance(m, tm.RMSNorm):
            m.forward = types.MethodType(norm_forward, m)
        elif isinstance(m, tm.Attention):
            m.rotate = types.MethodType(rotate, m)
        elif isinstance(m, tm.MLP):
            m.forward = types.MethodType(mlp_forward, m)
    apply_liger_kernel_to_qwen3_5(rope=False, fused_linear_cross_entropy=False, rms_norm=True, swiglu=True,
                                  model=target_model)
    return undo
