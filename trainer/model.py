"""The DFlash drafter: a short stack of Qwen3-style decoder layers conditioned on target features.

The drafter has no embedding or LM head of its own; the caller embeds the block tokens with the
target's (frozen) embedding and reads logits through the target's LM head.

Shapes: B batch, S context length (target positions), N draft blocks per sequence, bs block size,
Tq = N * bs draft positions, H hidden size, k target layers. Attention tensors are ``[B, T, H, D]``.

Per layer, the keys and values are ``[context (S) | block_0 | ... | block_{N-1}]``: the context
rows come from the target features through this layer's own k/v projections and k-norm, the block
rows from the draft hidden states; queries come only from the draft positions. RoPE positions are
0..S-1 for the context and ``anchor_i + j`` for position j of block i, so a draft token sits where
the token it predicts would be. Which keys a block sees is :func:`dflash_kernels.dflash_block_mask`:
context ``kv < anchor`` (within ``sliding_window`` on sliding layers) and its own block.
"""

import json
import os
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import dflash_kernels as dk
from dflash_kernels.ops.rms_norm import rms_norm as fused_rms_norm
from dflash_kernels.ops.rope import apply_rope as fused_apply_rope
from dflash_kernels.ops.swiglu import swiglu as fused_swiglu

__all__ = ["DrafterConfig", "DFlashDrafter", "RMSNorm", "rope_cos_sin", "apply_rope", "swiglu", "FUSED_OPS"]

# The drafter's RMSNorm, RoPE and SwiGLU: "auto" (the default) runs the fused dflash_kernels ops (same
# math: fp32 inside, one rounding to the activation dtype) on CUDA tensors and the plain torch chains
# elsewhere (on the CPU the ops would run the Triton interpreter, many times slower than torch); False
# runs the plain chains everywhere, True the fused ops everywhere (DFLASH_DRAFTER_FUSED=0 / auto / 1).
# The fused ops make a GPU step faster: one pass per op instead of an fp32 chain of casts and broadcast
# products (benchmarks/tok_s.py times it: group (a) against (e)). Read at each call, so tests can
# compare the two paths on one model.
FUSED_OPS = {"1": True, "0": False}.get(os.environ.get("DFLASH_DRAFTER_FUSED", "auto"), "auto")


def _fused(x) -> bool:
    return x.is_cuda if FUSED_OPS == "auto" else bool(FUSED_OPS)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass
class DrafterConfig:
    hidden_size: int  # H, the target's hidden size
    intermediate_size: int  # SwiGLU width
    vocab_size: int  # the target's vocabulary (the drafter reads logits through the target's LM head)
    num_layers: int = 5  # decoder layers
    num_heads: int = 32  # query heads
    num_kv_heads: int = 8  # key/value heads
    head_dim: int = 128  # per-head width (64, 128 or 256)
    rope_theta: float = 1_000_000.0  # RoPE base
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    block_size: int = 16  # positions per draft block
    mask_token_id: int = 0  # token id at block positions 1..block_size-1
    target_layer_ids: list[int] = field(default_factory=list)  # decoder-layer indices whose outputs are the features
    layer_types: list[str] = field(default_factory=list)  # per layer "sliding_attention" or "full_attention"
    sliding_window: int = 2048  # context window of sliding layers

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_layers
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types: expected {self.num_layers} entries, got {len(self.layer_types)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads: must be a multiple of num_kv_heads={self.num_kv_heads}, got {self.num_heads}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids: at least one target layer is needed")


class _InvRms(torch.autograd.Function):
    """``rsqrt(mean(xf^2, -1) + eps)`` ``[..., 1]`` of fp32 ``xf`` ``[..., D]``: the forward is the plain chain's
    own ops; the backward gives autograd's gradient of that chain bit for bit in one full-size pass.

    Autograd differentiates ``pow -> mean -> + eps -> rsqrt`` as ``g = -0.5 * grad * r^3`` (per row), then
    ``g.expand(D) / D`` (a strided fp32 division over all of ``xf``: CUDA runs it non-vectorized), then
    ``that * (2.0 * xf.pow(1.0))`` (a copy of ``xf``, a scaling and a product): four full-size passes. Here the
    division runs per row before the broadcast (the same quotient in every element) and the exact factor 2
    moves onto the row term (``fl(g * fl(2 x)) == fl(fl(2 g) * x)``: doubling is exact), so one broadcast
    product remains. ``tools.audits.copy_audit`` found the four passes;
    ``tests/trainer/test_no_hidden_copies.py`` keeps them out and checks the gradients bit for bit.
    """

    @staticmethod
    def forward(ctx, xf, eps):
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(xf, r)
        return r

    @staticmethod
    def backward(ctx, grad):
        xf, r = ctx.saved_tensors
        g = -0.5 * grad * r.pow(3)  # RsqrtBackward0, as autograd writes it
        g = g / xf.shape[-1]  # MeanBackward1's division by D, per row
        return (g * 2.0) * xf, None  # PowBackward0: grad * (2 * xf), the exact 2 on the row term


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if _fused(x):
            return fused_rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * _InvRms.apply(xf, self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """cos, sin ``[B, T, 1, head_dim]`` (fp32) for integer positions ``[B, T]`` (rotate-half layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim)
    ang = positions.double()[..., None] * inv_freq  # fp64 angles: exact enough at positions ~1e5
    ang = torch.cat([ang, ang], -1)[:, :, None, :]
    return ang.cos().float(), ang.sin().float()


def _rounded(t: torch.Tensor, dtype) -> torch.Tensor:
    """``t`` rounded to ``dtype``, kept in ``t``'s dtype (the values of ``t.to(dtype)``, exactly)."""
    return t if t.dtype == dtype else t.to(dtype).to(t.dtype)


def apply_rope(x, cos, sin):
    """x ``[B, T, H, D]``, cos / sin ``[B, T, 1, D]``; rotate-half RoPE as in Qwen3/Llama (fp32 math)."""
    if _fused(x):
        return fused_apply_rope(x, cos, sin)
    x1, x2 = x.chunk(2, -1)
    rot = torch.cat([-x2, x1], -1)
    return (x.float() * cos + rot.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.Hq, self.Hkv, self.D = cfg.num_heads, cfg.num_kv_heads, D
        self.q_proj = nn.Linear(H, self.Hq * D, bias=False)
        self.k_proj = nn.Linear(H, self.Hkv * D, bias=False)
        self.v_proj = nn.Linear(H, self.Hkv * D, bias=False)
        self.o_proj = nn.Linear(self.Hq * D, H, bias=False)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_ctx, mask):
        """x ``[B, Tq, H]`` (normed draft states), ctx ``[B, S, H]`` (target features) -> ``[B, Tq, H]``."""
        B, Tq, _ = x.shape
        S = ctx.shape[1]
        q = self.q_norm(self.q_proj(x).view(B, Tq, self.Hq, self.D))
        kx = self.k_norm(self.k_proj(x).view(B, Tq, self.Hkv, self.D))
        vx = self.v_proj(x).view(B, Tq, self.Hkv, self.D)
        kc = self.k_norm(self.k_proj(ctx).view(B, S, self.Hkv, self.D))
        vc = self.v_proj(ctx).view(B, S, self.Hkv, self.D)
        q, kx, kc = self.rotate(q, kx, kc, rope_q, rope_ctx)
        dtype = q.dtype
        k = torch.cat([kc, kx], 1).to(dtype)
        v = torch.cat([vc, vx], 1).to(dtype)
        o = self.attend(q, k, v, mask)
        return self.o_proj(o.reshape(B, Tq, self.Hq * self.D))

    def rotate(self, q, kx, kc, rope_q, rope_ctx):
        """RoPE of the queries and draft keys (at the draft positions) and of the context keys (benchmarks
        swap in a peer's RoPE here)."""
        return apply_rope(q, *rope_q), apply_rope(kx, *rope_q), apply_rope(kc, *rope_ctx)

    def attend(self, q, k, v, mask):
        """The attention itself, ``[B, T, H, D]`` in and out (benchmarks swap in a peer here)."""
        return dk.block_sparse_attention(q, k, v, mask)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def swiglu(gate, up):
    """``silu(gate) * up``; the fused op computes it in fp32 with one rounding (the plain path rounds
    ``silu(gate)`` to the activation dtype first, as torch does)."""
    if _fused(gate):
        return fused_swiglu(gate, up)
    return F.silu(gate) * up


def add_rms_norm(norm: RMSNorm, x, residual):
    """``(norm(h), h)`` with ``h = x + residual``: the fused op (one pass forward and backward, the residual
    stream's gradient added in the norm's backward) where the drafter runs its fused ops, else the add and
    the norm. The same h either way (one rounding of the sum)."""
    if _fused(x):
        return dk.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    h = x + residual
    return norm(h), h


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, ctx, rope_q, rope_ctx, mask, residual=None):
        """Pre-norm residual layer, ``h + attn(norm(h))`` then ``+ mlp(norm(.))``, with the adds folded into
        the norms after them: ``residual`` None, ``x`` is the layer's input h; else the input is
        ``x + residual`` (``x`` the previous layer's MLP output). Returns ``(mlp output, residual)``, whose
        sum is the layer's output."""
        if residual is None:
            a, residual = self.input_layernorm(x), x
        else:
            a, residual = add_rms_norm(self.input_layernorm, x, residual)
        a = self.self_attn(a, ctx, rope_q, rope_ctx, mask)
        m, residual = add_rms_norm(self.post_attention_layernorm, a, residual)
        return self.mlp(m), residual


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        k = len(cfg.target_layer_ids)
        self.fc = nn.Linear(k * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)

    def masks(self, anchors, context_len, valid=None):
        """The block masks the layers need: ``{"full_attention": m, "sliding_attention": m}``."""
        cfg = self.config
        out = {}
        # The anchors' range check reads a device value back (a host synchronization per step on a GPU):
        # it runs where that is free; the trainer checks its batches' anchors on the host
        # (trainer.step.drafter_loss) before they move to the device.
        check = anchors.device.type == "cpu"
        for t in set(cfg.layer_types):
            window = cfg.sliding_window if t == "sliding_attention" else None
            out[t] = dk.dflash_block_mask(anchors, context_len, cfg.block_size, window=window, valid=valid,
                                          check_range=check)
        return out

    def forward(self, block_embeds, target_hidden, anchors, valid=None, masks=None):
        """Draft hidden states after the final norm (feed them to the target's LM head).

        Args:
            block_embeds: ``[B, N * bs, H]``, the target's embeddings of the block tokens (the anchor
                token at position 0 of each block, the mask token elsewhere).
            target_hidden: ``[B, S, k * H]``, the k target layers' outputs concatenated on the last dim.
            anchors: int ``[B, N]``, the context position of each block's anchor token.
            valid: optional bool ``[B, N]``; invalid (padding) blocks see nothing.
            masks: optional prebuilt :meth:`masks` (anchors, S, valid) to share between calls.
        Returns:
            ``[B, N * bs, H]``.
        """
        cfg = self.config
        B, Tq, _ = block_embeds.shape
        S = target_hidden.shape[1]
        bs = cfg.block_size
        if Tq != anchors.shape[1] * bs:
            raise ValueError(f"block_embeds: expected {anchors.shape[1]} * {bs} positions, got {Tq}")
        if masks is None:
            masks = self.masks(anchors, S, valid)
        ctx = self.hidden_norm(self.fc(target_hidden))
        dev = block_embeds.device
        pos_q = (anchors.long()[:, :, None] + torch.arange(bs, device=dev)).reshape(B, Tq)
        pos_ctx = torch.arange(S, device=dev).expand(B, S)
        # cos / sin rounded to the activations' dtype, then held in fp32: the plain RoPE multiplies fp32
        # activations by them, and a bf16 table made each of those products (forward and backward) a
        # mixed-dtype kernel (CUDA's dynamic-casting path) with the same result.
        rope_q = tuple(_rounded(t, ctx.dtype) for t in rope_cos_sin(pos_q, cfg.head_dim, cfg.rope_theta))
        rope_ctx = tuple(_rounded(t, ctx.dtype) for t in rope_cos_sin(pos_ctx, cfg.head_dim, cfg.rope_theta))
        x, residual = block_embeds.to(ctx.dtype), None
        for layer in self.layers:
            x, residual = layer(x, ctx, rope_q, rope_ctx, masks[layer.layer_type], residual)
        return self.norm(x) if residual is None else add_rms_norm(self.norm, x, residual)[0]

    def save_pretrained(self, path: str) -> None:
        """An HF-style folder: ``config.json`` (with the DFlash fields) and ``model.safetensors``."""
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        meta = {"architectures": ["DFlashDrafter"], "model_type": "dflash_drafter", **asdict(self.config)}
        tmp = os.path.join(path, CONFIG_NAME + ".tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(tmp, os.path.join(path, CONFIG_NAME))
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        tmp = os.path.join(path, WEIGHTS_NAME + ".tmp")
        save_file(state, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(path, WEIGHTS_NAME))

    @classmethod
    def from_pretrained(cls, path: str, device="cpu") -> "DFlashDrafter":
        from safetensors.torch import load_file

        with open(os.path.join(path, CONFIG_NAME)) as f:
            meta = json.load(f)
        fields = DrafterConfig.__dataclass_fields__
        model = cls(DrafterConfig(**{k: v for k, v in meta.items() if k in fields}))
        model.load_state_dict(load_file(os.path.join(path, WEIGHTS_NAME), device=str(device)))
        return model.to(device)
