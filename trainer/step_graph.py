"""The drafter's half of a training step (loss -> backward -> clip -> optimizer step), eager or as one
CUDA graph per batch shape.

With the target's forward already replayed as CUDA graphs (``Target.use_cuda_graphs``), what is left of
the host's work in a step is the drafter's: a few hundred launches of forward, backward, gradient
clip and AdamW, each with its Python, autograd and dispatch cost. Where the host launches slower than
the GPU runs them the GPU waits (``benchmarks/tok_s.py``'s ``device_idle_ms``). :class:`DrafterStep`
records the whole drafter half once per batch shape and replays it: one launch a step.

How a shape is captured (the recipe of PyTorch's whole-network capture):

- its first step runs eagerly (kernel compiles and tuning, the optimizer's state), as any step would;
- its second step first runs the forward and backward once more without the update on the capture
  stream (that stream's library workspaces), then records the step into a graph (nothing runs while
  recording) and replays it: each call is exactly one optimizer step;
- the inputs are copied into the graph's own buffers before each replay, and the outputs (loss,
  statistics, gradient norm) copied out of them after it, so a caller may keep them across steps.

What has to hold, and is set here: the optimizer's groups are ``capturable`` and their learning rate is
a device tensor (a float would be recorded into the graph; ``LambdaLR`` fills the tensor in place).
With ``compute_weights="copies"`` that is ``MasterAdamW``'s capturable mode (its step counts on the device,
the bias corrections computed there). Packed batches (``doc_ids``) run eagerly; a CPU drafter and an
optimizer without a capturable mode are refused with ``graphs=True`` (a CPU drafter is stepped eagerly by
the config's "auto"). Memory: each graph keeps the step's intermediates in a pool of its own (the
eager steps' cached blocks are released after a capture).
"""

import dataclasses
import threading

import torch

from trainer.step import _check_anchors, clip_and_step, drafter_loss

__all__ = ["DrafterStep", "GRAPH_INPUTS"]

# the batch's tensors the drafter half reads (the target's features come separately)
GRAPH_INPUTS = ("input_ids", "loss_mask", "lengths", "anchors", "valid")


@dataclasses.dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: dict  # the batch's tensors, the graph's own copies
    feats: torch.Tensor
    loss: torch.Tensor  # outputs, overwritten by each replay
    stats: object  # trainer.loss.StepStats
    gnorm: torch.Tensor
    grads: list  # the gradients the graph writes and reads, kept alive with it
    lock: threading.Lock


class DrafterStep:
    """``step(batch, feats) -> (loss, stats, grad_norm)``: one optimizer step of ``drafter`` on a batch and
    its target features, as ``forward_loss`` + ``backward`` + :func:`trainer.step.clip_and_step`; leaves no
    gradients behind (``zero_grad(set_to_none=True)``). The learning-rate schedule stays the caller's.

    ``graphs=True``: as CUDA graphs per batch shape (module docstring); refused (``ValueError`` naming
    ``step_cuda_graphs``) for a drafter off CUDA or an optimizer without a capturable mode.
    """

    def __init__(self, drafter, heads, opt, cfg, dev, dtype, graphs: bool = False):
        self.drafter, self.heads, self.opt, self.cfg = drafter, heads, opt, cfg
        self.dev, self.dtype = torch.device(dev), dtype
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.graphs = bool(graphs)
        self._graphs = {}  # batch-shape key -> _Graph
        self._seen = set()  # keys that ran one eager step
        self._lock = threading.Lock()
        self._stream = None
        if self.graphs:
            self._make_capturable()

    def _make_capturable(self):
        if self.dev.type != "cuda":
            raise ValueError(f"step_cuda_graphs: needs the drafter on a CUDA device, it is on {self.dev}")
        for g in self.opt.param_groups:
            if "capturable" not in g:
                raise ValueError(f"step_cuda_graphs: {type(self.opt).__name__} has no capturable mode")
            g["capturable"] = True
            lr = g["lr"]
            if not (isinstance(lr, torch.Tensor) and lr.device == self.dev):
                # fp32 for torch's AdamW; MasterAdamW asks for fp64, the host path's precision (lr_dtype)
                dtype = getattr(self.opt, "lr_dtype", torch.float32)
                g["lr"] = torch.tensor(float(lr), dtype=dtype, device=self.dev)
        for state in self.opt.state.values():  # a restored non-capturable state keeps its step counts on the host
            if isinstance(state.get("step"), torch.Tensor) and state["step"].device != self.dev:
                state["step"] = state["step"].to(self.dev, torch.float32)

    @staticmethod
    def key(batch: dict, feats: torch.Tensor):
        return (tuple(feats.shape), feats.dtype, feats.device) + tuple(
            (tuple(batch[k].shape), batch[k].dtype) for k in GRAPH_INPUTS)

    def __call__(self, batch: dict, feats: torch.Tensor):
        if not self.graphs or "doc_ids" in batch:
            return self.eager(batch, feats)
        key = self.key(batch, feats)
        entry = self._graphs.get(key)
        if entry is None:
            with self._lock:
                entry = self._graphs.get(key)
                if entry is None:
                    if key not in self._seen:
                        self._seen.add(key)
                        return self.eager(batch, feats)
                    entry = self._graphs[key] = self.capture(batch, feats)
        return self._replay(entry, batch, feats)

    def _forward_backward(self, batch, feats):
        loss, stats = drafter_loss(batch, feats, self.heads, self.drafter, self.cfg, self.dev, self.dtype)
        loss.backward()
        return loss, stats

    def eager(self, batch: dict, feats: torch.Tensor):
        """One step without graphs."""
        loss, stats = self._forward_backward(batch, feats)
        gnorm = clip_and_step(self.opt, self.params, self.cfg.grad_clip)
        self.opt.zero_grad(set_to_none=True)
        return loss.detach(), stats, gnorm.detach()

    def capture(self, batch: dict, feats: torch.Tensor) -> _Graph:
        """Record the step for ``batch``'s shapes (the optimizer's state must exist: one eager step ran).
        The forward and backward run once first on the capture stream, without the update."""
        if not self.opt.state:
            raise RuntimeError("DrafterStep.capture: run one eager step first (the optimizer has no state yet)")
        dev = self.dev
        here = torch.cuda.current_stream(dev)
        if self._stream is None:
            self._stream = torch.cuda.Stream(dev)
        side = self._stream
        inputs = {k: torch.empty(batch[k].shape, dtype=batch[k].dtype, device=dev) for k in GRAPH_INPUTS}
        for k, t in inputs.items():
            t.copy_(batch[k])
        static_feats = feats.detach().clone()
        side.wait_stream(here)
        with torch.cuda.stream(side):  # the capture stream's workspaces (cuBLAS, the library's), no update
            self._forward_backward(inputs, static_feats)
        self.opt.zero_grad(set_to_none=True)  # the graph's backward writes fresh gradients in its own pool
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads' CUDA work (the target's, other drafters') may go on meanwhile
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            loss, stats = self._forward_backward(inputs, static_feats)
            gnorm = clip_and_step(self.opt, self.params, self.cfg.grad_clip)
        here.wait_stream(side)
        # kept alive with the graph, which writes and reads them (MasterAdamW: the bf16 leaves' gradients)
        grads = self.opt.grads() if hasattr(self.opt, "grads") else [p.grad for p in self.params]
        self.opt.zero_grad(set_to_none=True)  # an eager step of another shape must not add to them
        # the eager steps' cached blocks (their activations) are not needed while the graph replays: give
        # them back, or the process holds the step's activations twice (about 6 GiB at the real preset)
        torch.cuda.empty_cache()
        return _Graph(graph=graph, inputs=inputs, feats=static_feats, loss=loss.detach(), stats=stats,
                      gnorm=gnorm.detach(), grads=grads, lock=threading.Lock())

    def _replay(self, e: _Graph, batch: dict, feats: torch.Tensor):
        _check_anchors(batch)  # the eager path's host check of the anchors, before anything moves
        with e.lock:
            for k, t in e.inputs.items():
                t.copy_(batch[k], non_blocking=True)
            e.feats.copy_(feats)
            e.graph.replay()
            return e.loss.clone(), e.stats.clone(), e.gnorm.clone()

    def is_captured(self, batch: dict, feats: torch.Tensor) -> bool:
        """Whether a step on this batch replays a graph (its shapes were captured)."""
        return self.graphs and "doc_ids" not in batch and self.key(batch, feats) in self._graphs

    def info(self) -> dict:
        """How many batch shapes run as graphs, and whether graphs are on."""
        return {"graphs": self.graphs, "captured": len(self._graphs)}
