"""bf16 compute copies of the drafter's matrix weights, written by the optimizer step (no autocast casts).

Under autocast the fp32 master weights are cast to bf16 in every forward, and the bf16 weight gradients
cast back to fp32 in every backward: a pass over every weight and every weight gradient per step.
Here each trainable 2-D fp32 weight has a bf16 leaf tensor the forward runs with
(``torch.func.functional_call``); its gradient stays bf16; :class:`MasterAdamW` reads it as it is, updates
the fp32 master and writes the leaf's new value in the same pass (``dflash_kernels.ops.adamw``). The
values are those of the autocast path: the leaf is the master rounded to bf16 (what autocast's cast
gives), its gradient the same bf16 numbers autocast's backward would cast to fp32 exactly. Checkpoints
keep the fp32 masters (``model.state_dict()`` unchanged); after loading one, :meth:`ComputeWeights.refresh`.
"""

import torch

from dflash_kernels.ops.adamw import fused_adamw_
from trainer.config import check_betas

__all__ = ["ComputeWeights", "MasterAdamW", "make_optimizer"]


class ComputeWeights:
    """The bf16 (``dtype``) leaves of ``model``'s trainable 2-D fp32 parameters."""

    def __init__(self, model: torch.nn.Module, dtype=torch.bfloat16):
        self.dtype = dtype
        self.copies = {}  # parameter name -> leaf
        self.of = {}  # parameter -> leaf
        for name, p in model.named_parameters():
            if p.requires_grad and p.dim() == 2 and p.dtype == torch.float32:
                leaf = p.detach().to(dtype).requires_grad_()
                self.copies[name] = leaf
                self.of[p] = leaf

    def __call__(self, model, *args, **kwargs):
        """``model(*args, **kwargs)`` with the leaves in place of their parameters."""
        return torch.func.functional_call(model, self.copies, args, kwargs, strict=False)

    @torch.no_grad()
    def refresh(self, model):
        """The leaves from the masters again (after a checkpoint was loaded into ``model``)."""
        params = dict(model.named_parameters())
        for name, leaf in self.copies.items():
            leaf.copy_(params[name])


class MasterAdamW(torch.optim.Optimizer):
    """AdamW (torch's math, decoupled weight decay) over fp32 masters, reading the bf16 leaves' gradients
    where :class:`ComputeWeights` has a leaf and writing the leaves in the same kernel pass.

    State per parameter as torch.optim.AdamW's (``step``, ``exp_avg``, ``exp_avg_sq``). ``capturable=False``:
    ``step`` kept on the host, so that the bias corrections need no read-back. ``capturable=True`` (torch's
    meaning; a group's option, set by ``trainer.step_graph.DrafterStep``): ``step`` a device tensor and ``lr``
    a host number or a device tensor, the bias corrections computed on the device: the step can be recorded
    into a CUDA graph. :meth:`step_with_clip` folds the gradient clip into the kernel
    (``trainer.step.clip_and_step`` calls it)."""

    # The dtype of a device-tensor learning rate (trainer.step_graph.DrafterStep makes one): fp64, so that
    # the capturable step's hyperparameters (fp64 on the device, then fp32) equal the host path's (Python
    # floats, then fp32). With an fp32 lr the two paths' step sizes differ by an fp32 rounding, enough to flip
    # a few bf16 roundings of the compute copies, and a run's losses then differ between the two paths.
    lr_dtype = torch.float64

    def __init__(self, params, compute_weights: ComputeWeights = None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, capturable: bool = False):
        super().__init__(params, dict(lr=lr, betas=check_betas(betas), eps=eps, weight_decay=weight_decay,
                                      capturable=capturable))
        self.compute_weights = compute_weights
        self.grad_scale = None

    def _grad(self, p):
        leaf = self.compute_weights.of.get(p) if self.compute_weights is not None else None
        return (leaf.grad, leaf) if leaf is not None else (p.grad, None)

    def grads(self):
        return [g for group in self.param_groups for p in group["params"] for g in [self._grad(p)[0]]
                if g is not None]

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # the step counts where this group keeps them (see the class)
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" in st:
                    where = p.device if group.get("capturable") else "cpu"
                    st["step"] = torch.as_tensor(st["step"]).detach().to(where, torch.float32)

    def zero_grad(self, set_to_none: bool = True):
        super().zero_grad(set_to_none)
        if self.compute_weights is not None:
            for leaf in self.compute_weights.of.values():
                leaf.grad = None  # the next backward hands its gradient over (no accumulation pass)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            capturable = group.get("capturable", False)
            by_step = {}  # host step count (capturable: one list, the counts on the device) -> tensors
            for p in group["params"]:
                g, leaf = self._grad(p)
                if g is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32, device=p.device if capturable else "cpu")
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if capturable and st["step"].device != p.device:
                    raise RuntimeError(f"MasterAdamW: capturable, but a step count is on {st['step'].device} and its "
                                       f"parameter on {p.device}")
                if not capturable:
                    st["step"] += 1
                lists = by_step.setdefault(None if capturable else int(st["step"]), ([], [], [], [], [], []))
                for lst, t in zip(lists, (p, g.contiguous(), st["exp_avg"], st["exp_avg_sq"], leaf, st["step"])):
                    lst.append(t)
            beta1, beta2 = group["betas"]
            lr = group["lr"] if isinstance(group["lr"], torch.Tensor) else float(group["lr"])
            for step, (ps, gs, ms, vs, leaves, steps) in by_step.items():
                if step is None:  # capturable: the counts advance on the device
                    torch._foreach_add_(steps, 1)
                fused_adamw_(ps, gs, ms, vs, lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                             weight_decay=group["weight_decay"], step=steps if step is None else step,
                             grad_scale=self.grad_scale,
                             compute_copies=leaves if any(c is not None for c in leaves) else None)
        return loss

    def precompile_specs(self, max_norm: float) -> list:
        """The ``dflash_kernels.precompile`` specs of the kernels :meth:`step_with_clip` (``max_norm``) will
        launch, as the groups are set now (``capturable`` included): compiled and tuned on scratch tensors
        before the loop's strict mode, never on the live parameters (the step is in place)."""
        specs = []
        for group in self.param_groups:
            on_device = bool(group.get("capturable")) or isinstance(group["lr"], torch.Tensor)
            seen, tensors = set(), []
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                leaf = self.compute_weights.of.get(p) if self.compute_weights is not None else None
                entry = (p.numel(), p.dtype, None) if leaf is None else (p.numel(), leaf.dtype, leaf.dtype)
                if entry[0] and entry not in seen:
                    seen.add(entry)
                    tensors.append(dict(numel=entry[0], grad_dtype=entry[1], copy_dtype=entry[2]))
            if tensors:
                specs.append(("adamw", dict(tensors=tensors, grad_scale=max_norm > 0, device_hparams=on_device),
                              torch.float32))
        return specs

    def step_with_clip(self, max_norm: float) -> torch.Tensor:
        """clip_grad_norm_'s total norm and coefficient (``min(1, max_norm / (norm + 1e-6))``), applied inside
        the step's kernel as the gradient scale ``1 / coef``; returns the norm (a device tensor). ``max_norm <= 0``:
        no clipping (the norm still returned)."""
        grads = self.grads()
        if not grads:
            return torch.zeros(())
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)), 2)
        if max_norm <= 0:
            self.step()
            return norm
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        self.grad_scale = (1.0 / coef).reshape(1)
        try:
            self.step()
        finally:
            self.grad_scale = None
        return norm


def make_optimizer(drafter: torch.nn.Module, cfg, dtype, kind: str) -> torch.optim.Optimizer:
    """The drafter's AdamW with ``cfg``'s lr, betas and weight decay, of one ``kind``:

    - ``"copies"``: :class:`MasterAdamW` over bf16 compute copies (sets ``drafter.compute_weights``, which
      ``trainer.step.drafter_loss`` runs the forward with); with an fp32 ``dtype`` there is nothing to copy
      and this is torch's fused AdamW on a GPU, its default elsewhere;
    - ``"fused"``: torch's fused kernel (on a GPU; torch's default on a CPU);
    - ``"foreach"``: torch's multi-tensor path (on a GPU; torch's default on a CPU).
    """
    if kind not in ("copies", "fused", "foreach"):
        raise ValueError(f"kind: expected 'copies', 'fused' or 'foreach', got {kind!r}")
    if kind == "copies" and dtype != torch.float32:
        drafter.compute_weights = ComputeWeights(drafter, dtype)
        return MasterAdamW(drafter.parameters(), drafter.compute_weights, lr=cfg.lr, betas=tuple(cfg.betas),
                           weight_decay=cfg.weight_decay)
    cuda = next(drafter.parameters()).is_cuda
    fused = cuda and kind in ("copies", "fused")
    return torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                             fused=fused, foreach=None if fused else cuda)
