"""One training step's forward, shared by the single-process loop (train.py) and the pipeline:
target features, then the drafter's weighted block loss. Packed rows (a batch with ``doc_ids``) run
every document through the target alone and limit each draft block's context to its own document."""

import torch

from trainer.config import TrainConfig
from trainer.loss import block_inputs, block_labels, dflash_head_loss, dflash_loss, predicted_positions
from trainer.target import Target

__all__ = ["forward_loss", "target_features", "drafter_loss", "attention_precompile_specs", "clip_and_step"]


def target_features(target: Target, batch: dict, dev) -> torch.Tensor:
    """The target half: features ``[B, S, k * H]`` of a batch (packed rows: every document alone)."""
    ids = batch["input_ids"].to(dev, non_blocking=True)
    if "doc_ids" in batch:
        from trainer.data import packed_target_features

        return packed_target_features(target, ids, batch["doc_ids"].to(dev, non_blocking=True))
    return target.features(ids)


def _check_anchors(batch: dict):
    """Valid anchors inside ``[0, S]``, checked on the host batch (the drafter's masks skip the device-side
    check, a synchronization); a batch already on a GPU is the caller's."""
    a = batch["anchors"]
    if a.device.type != "cpu":
        return
    S = batch["input_ids"].shape[1]
    bad = ((a < 0) | (a > S)) & batch["valid"].to(torch.bool)
    if bool(bad.any()):
        b, n = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"anchors: every valid anchor must be in [0, {S}]; got anchors[{b}, {n}] = {int(a[b, n])}")


def drafter_loss(batch: dict, feats: torch.Tensor, heads, drafter, cfg: TrainConfig, dev, dtype):
    """The drafter half of :func:`forward_loss` (features computed elsewhere: the pipeline's target GPUs)."""
    _check_anchors(batch)
    ids = batch["input_ids"].to(dev, non_blocking=True)
    lm = batch["loss_mask"].to(dev, non_blocking=True)
    lengths = batch["lengths"].to(dev, non_blocking=True)
    anchors = batch["anchors"].to(dev, non_blocking=True)
    valid = batch["valid"].to(dev, non_blocking=True)
    dcfg = drafter.config
    with torch.no_grad():
        emb = heads.embed(block_inputs(ids, anchors, dcfg.mask_token_id, dcfg.block_size))
    labels, counted = block_labels(ids, lm, lengths, anchors, valid, dcfg.block_size)
    masks = None
    if "doc_ids" in batch:  # packed rows: a block's context is its own document only
        from trainer.data import packed_drafter_masks

        masks = packed_drafter_masks(drafter, anchors, batch["doc_ids"].to(dev, non_blocking=True), valid)
    # fp32 master weights under autocast wherever the compute dtype is lower (a CPU bf16 run too: the
    # same casts as on a GPU, which is what tools.audits.copy_audit inspects).
    with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
        cw = getattr(drafter, "compute_weights", None)  # trainer.compute_weights: bf16 leaves, no casts
        hidden = drafter(emb, feats, anchors, valid, masks=masks) if cw is None else cw(
            drafter, emb, feats, anchors, valid, masks=masks)
        # every loss path: the LM head sees block positions 1..bs-1 only (position 0 is never predicted)
        hidden, labels, counted = predicted_positions(hidden, labels, counted)
        logits = heads.lm_head(hidden) if cfg.loss == "logits" else None
    if logits is not None:
        return dflash_loss(logits, labels, counted, cfg.gamma, first=1)
    weight, bias = heads.lm_head_params()
    # "fused": the library's fused LM head + cross-entropy; "chunked": plain torch in row chunks. Neither
    # holds the whole [rows, vocab] logits (nor their fp32 copy and gradient).
    return dflash_head_loss(hidden, weight, labels, counted, cfg.gamma, bias=bias, fused=cfg.loss == "fused",
                            first=1)


def forward_loss(batch: dict, target: Target, drafter, cfg: TrainConfig, dev, dtype):
    """One batch -> (loss, stats). The target runs without grad; only the drafter is differentiated."""
    return drafter_loss(batch, target_features(target, batch, dev), target, drafter, cfg, dev, dtype)


def attention_precompile_specs(cfg: TrainConfig, drafter_config, dtype) -> list:
    """``dflash_kernels.precompile`` specs of the drafter's attention: one per layer type (full and
    sliding window) at the run's batch, length and anchor count."""
    dc = drafter_config
    specs = []
    for t in sorted(set(dc.layer_types)):
        shape = dict(B=cfg.batch_size, S=cfg.max_len, N=cfg.num_anchors, Hq=dc.num_heads, Hkv=dc.num_kv_heads,
                     D=dc.head_dim, block_size=dc.block_size)
        if t == "sliding_attention":
            shape["window"] = dc.sliding_window
        specs.append(("attention", shape, dtype))
    return specs


def clip_and_step(opt: torch.optim.Optimizer, params, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_(params, max_norm)`` then ``opt.step()``; returns the total gradient norm (a device
    tensor: nothing is read back).

    With torch's fused AdamW the clip is folded into the optimizer's kernel instead of a separate pass
    over every gradient: the kernel divides each gradient by ``grad_scale`` (the hook ``GradScaler``
    uses), here ``1 / coef`` with clip_grad_norm_'s ``coef = min(1, max_norm / (norm + 1e-6))``. Saves one
    read and write of all gradients (the clip's foreach multiply); the
    clipped gradients differ from clip_grad_norm_'s by a rounding (a division by 1 / coef, not a
    multiplication by coef) and are exact when no clipping happens (coef = 1). Other optimizers:
    clip_grad_norm_ as is."""
    if hasattr(opt, "step_with_clip"):  # trainer.compute_weights.MasterAdamW: its own gradients, clip in-kernel
        return opt.step_with_clip(max_norm)
    params = [p for p in params if p.grad is not None]
    fused = all(g.get("fused") for g in opt.param_groups)
    if max_norm <= 0:  # no clipping (HF Trainer's max_grad_norm <= 0); the norm is still reported
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0) if params else torch.zeros(())
        opt.step()
        return norm
    if not fused or not params:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
        return norm
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    opt.grad_scale = 1.0 / coef
    try:
        opt.step()
    finally:
        del opt.grad_scale
    return norm
