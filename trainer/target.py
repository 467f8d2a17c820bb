"""The frozen target: any local HF causal-LM folder, loaded offline, giving hidden states of chosen layers.

Qwen3 (dense) and Qwen3.5 / Qwen3-Next (Gated DeltaNet hybrids) are the first-class architectures;
anything ``AutoModelForCausalLM`` loads with ``output_hidden_states`` works.
"""

import inspect
import os
import sys
import threading

import torch

from trainer.config import default_target_layer_ids

__all__ = ["Target", "load_target", "resolve_mask_token_id", "use_torch_path", "TorchPath"]

# The module-level functions a Qwen3.5 / Qwen3-Next linear-attention layer calls by name.
HYBRID_FUNCTIONS = ("causal_conv1d_fn", "causal_conv1d_update", "torch_chunk_gated_delta_rule",
                    "torch_recurrent_gated_delta_rule")


class _Enough(Exception):
    """Raised by the layer tap once the deepest layer :meth:`Target.features` needs has run."""


class Target:
    """A frozen causal LM plus its tokenizer.

    ``layer_ids`` are decoder-layer indices: layer i's output is HF's ``hidden_states[i + 1]``
    (index 0 is the embedding output).

    :meth:`features` stops the forward after the deepest layer it needs: the decoder layers past it,
    the final norm and the LM head are not run (two of 32 layers of the ``real`` preset's target).
    Forward hooks on the decoder layers (``model.base_model.layers``) take the chosen layers' outputs;
    they act only for the thread inside :meth:`features` (a thread-local request), so target threads
    sharing one model stay independent. A model without such a layer list, or a deepest layer that
    is the last one (HF gives the final-normed state there), runs the whole forward as before.
    """

    def __init__(self, model, tokenizer, layer_ids):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.num_layers = text.num_hidden_layers
        self.hidden_size = text.hidden_size
        self.intermediate_size = getattr(text, "intermediate_size", 4 * text.hidden_size)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.layer_ids = list(layer_ids)
        bad = [i for i in self.layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"target_layer_ids: {bad} outside [0, {self.num_layers - 1}] for this target")
        self._request = threading.local()
        layers = getattr(getattr(model, "base_model", None), "layers", None)
        self._tapped = (isinstance(layers, torch.nn.ModuleList) and len(layers) == self.num_layers
                        and max(self.layer_ids) < self.num_layers - 1)
        if self._tapped:
            for i, layer in enumerate(layers):
                layer.register_forward_hook(self._tap(i))
        # The attention-mask mapping transformers would build for an unpadded, unpacked batch without a
        # cache, passed ready-made (see _mask_kwargs); None: the model has no layer types to key it by.
        types = getattr(text, "layer_types", None)
        self._mask_types = sorted(set(types)) if types else None
        self._no_masks = {}  # (shape, device) -> bool: the all-None mapping gives the same features
        self._no_masks_lock = threading.Lock()
        self._graphs = None  # use_cuda_graphs: (shape, dtype, device, stream) -> (graph, in, out, lock)
        self._graphs_lock = threading.Lock()

    def _tap(self, i):
        def hook(module, args, output):
            want = getattr(self._request, "want", None)
            if want is None:  # this thread is not inside features(): nothing to take
                return
            if i in want:
                want[i] = output[0] if isinstance(output, tuple) else output
            if i == self._request.last:
                raise _Enough
        return hook

    @property
    def layers_run(self) -> int:
        """Decoder layers :meth:`features` runs: up to the deepest feature layer when it can stop there,
        else all of them (the model FLOP count of ``trainer.flops`` takes this)."""
        return max(self.layer_ids) + 1 if self._tapped else self.num_layers

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def dtype(self):
        return next(self.model.parameters()).dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``[B, T]`` -> the target's input embeddings ``[B, T, H]``."""
        return self.model.get_input_embeddings()(ids)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[..., H]`` -> logits ``[..., V]`` through the target's output layer."""
        head = self.model.get_output_embeddings()
        return head(h.to(head.weight.dtype))

    def lm_head_params(self):
        """The output layer's ``(weight [V, H], bias [V] or None)``, for the chunked loss."""
        head = self.model.get_output_embeddings()
        return head.weight, getattr(head, "bias", None)

    def _select(self, hidden_states):
        return torch.cat([hidden_states[i + 1] for i in self.layer_ids], -1)

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, S]`` token ids (right-padded) -> concatenated layer outputs ``[B, S, k * H]``.

        No attention mask is passed: with right padding a causal model's valid positions never see
        the pads, so their states are exact, and the pad positions are never read by the drafter
        (anchors and labels stay inside each sequence).
        """
        if self._graphs is not None and input_ids.is_cuda:
            return self._graphed(input_ids)
        return self._features(input_ids, self._mask_kwargs(input_ids))

    def use_cuda_graphs(self, enabled: bool = True) -> None:
        """Run :meth:`features` as replays of CUDA graphs (the frozen forward's kernels launched at once,
        without the host's per-op work): one graph per input shape, device and stream, captured at its
        first call after two eager warm-up calls (kernel compiles, tuning and library workspaces happen
        there, never inside a capture). A replay copies the ids into the graph's input buffer and returns
        a copy of its output. Memory: each graph keeps its forward's intermediates in a pool of its own.
        Packed batches (``trainer.data.packed_target_features``) and CPU inputs run eagerly."""
        if enabled and self.device.type != "cuda":
            raise ValueError(f"target_cuda_graphs: needs the target on a CUDA device, it is on {self.device}")
        with self._graphs_lock:
            self._graphs = {} if enabled else None

    def _graphed(self, input_ids):
        stream = torch.cuda.current_stream(input_ids.device)
        key = (tuple(input_ids.shape), input_ids.dtype, input_ids.device, stream.cuda_stream)
        graphs = self._graphs
        entry = graphs.get(key)
        if entry is None:
            with self._graphs_lock:
                entry = graphs.get(key)
                if entry is None:
                    entry = graphs[key] = self._capture(input_ids)
        graph, static_in, static_out, lock = entry
        with lock:  # threads sharing a stream: each one's copy-in, replay and copy-out stay together in it
            static_in.copy_(input_ids)
            graph.replay()
            return static_out.clone()

    def _capture(self, input_ids):
        kwargs = self._mask_kwargs(input_ids)  # its first call per shape compares two forwards (a sync)
        static_in = input_ids.clone()
        here = torch.cuda.current_stream(input_ids.device)
        side = torch.cuda.Stream(input_ids.device)  # warm-up and capture on one stream (per-stream workspaces)
        side.wait_stream(here)
        with torch.cuda.stream(side):
            for _ in range(2):
                self._features(static_in, kwargs)
        here.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads' CUDA work (other targets, drafters) may go on during the capture
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            static_out = self._features(static_in, kwargs)
        return graph, static_in, static_out, threading.Lock()

    def _features(self, input_ids, kwargs):
        if not self._tapped:
            out = self.model.base_model(input_ids=input_ids, output_hidden_states=True, use_cache=False, **kwargs)
            return self._select(out.hidden_states)
        want = dict.fromkeys(self.layer_ids)
        self._request.want, self._request.last = want, max(self.layer_ids)
        try:
            self.model.base_model(input_ids=input_ids, use_cache=False, **kwargs)
        except _Enough:
            pass
        else:
            raise RuntimeError(f"target: the forward ended without running layer {self._request.last}")
        finally:
            self._request.want = None
        return torch.cat([want[i] for i in self.layer_ids], -1)

    def _mask_kwargs(self, input_ids) -> dict:
        """``{"attention_mask": {layer type: None}}`` where that gives this model the same features as
        no mask, else ``{}``. Without a mask transformers builds the mapping itself on every forward, and
        its packed-sequence check (``find_packed_sequence_indices``) reads a device value back: a host
        synchronization at the start of every step. For an unpadded, unpacked batch without a cache
        the mapping depends on the shape only (Qwen3.5's is all None: causal SDPA, unmasked GDN), so the
        first call of a shape and device runs the forward both ways and keeps the ready-made mapping
        only if the features are bit-identical (any other model, or an error, keeps transformers' own)."""
        if self._mask_types is None:
            return {}
        key = (tuple(input_ids.shape), input_ids.device)
        ok = self._no_masks.get(key)
        if ok is None:
            with self._no_masks_lock:
                ok = self._no_masks.get(key)
                if ok is None:
                    kwargs = {"attention_mask": dict.fromkeys(self._mask_types)}
                    try:
                        ok = torch.equal(self._features(input_ids, {}), self._features(input_ids, kwargs))
                    except Exception:  # noqa: BLE001 - a model that takes no mapping keeps its own path
                        ok = False
                    self._no_masks[key] = ok
        return {"attention_mask": dict.fromkeys(self._mask_types)} if ok else {}

    @torch.no_grad()
    def logits_and_features(self, input_ids: torch.Tensor):
        """Full forward: logits ``[B, S, V]`` and features ``[B, S, k * H]`` (for evaluation)."""
        out = self.model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
        return out.logits, self._select(out.hidden_states)


def load_target(path: str, layer_ids=None, k: int = 5, device="cpu", dtype=torch.float32,
                use_kernels: bool = True, elementwise=None, gdn_layers: bool = False) -> Target:
    """Load a local HF causal-LM folder (no hub access) and its tokenizer, frozen, on ``device``.

    With ``use_kernels`` a hybrid target's Gated DeltaNet and short-conv layers run on dflash_kernels
    (``dflash_kernels.integrations.transformers``); dense targets have none and run unchanged.
    ``elementwise`` (default: on a CUDA device) also routes its norms, SiLU MLPs and RoPE to the fused
    ops (``use_dflash_kernels(..., elementwise=True)``: process-wide, as transformers' functions are).
    ``gdn_layers`` routes the GDN layers' forward too (q and k at their own head count, the gate computed in
    the kernels; the trainer sets it where the target's forward runs as CUDA graphs, which take its extra
    host work out of the step).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isdir(path):
        raise ValueError(f"target: {path!r} is not a folder (a local HF model directory is expected; "
                         f"build the embedded default with `python -m trainer.build_default`)")
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    model.to(device)
    if use_kernels:
        from dflash_kernels.integrations.transformers import use_dflash_kernels
        try:
            use_dflash_kernels(model, elementwise=torch.device(device).type == "cuda" if elementwise is None
                               else elementwise, gdn_layers=gdn_layers)
        except ValueError:
            pass  # no linear-attention layers (a dense target): nothing to route
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    ids = list(layer_ids) if layer_ids else default_target_layer_ids(text.num_hidden_layers, k)
    return Target(model, tok, ids)


def resolve_mask_token_id(tokenizer, vocab_size: int, configured=None) -> int:
    """The mask token: the configured id, else the tokenizer's mask token, its pad token, or vocab - 1."""
    if configured is not None:
        mid = int(configured)
    elif getattr(tokenizer, "mask_token_id", None) is not None:
        mid = tokenizer.mask_token_id
    elif getattr(tokenizer, "pad_token_id", None) is not None:
        mid = tokenizer.pad_token_id
    else:
        mid = vocab_size - 1
    if not 0 <= mid < vocab_size:
        raise ValueError(f"mask_token_id: {mid} outside the vocabulary [0, {vocab_size - 1}]")
    return mid


class TorchPath:
    """The modeling-module globals :func:`use_torch_path` replaced; ``undo()`` puts them back."""

    def __init__(self, replaced):
        self.replaced = list(replaced)  # (module, name, the function that was there)

    def undo(self) -> None:
        for module, name, fn in self.replaced:
            setattr(module, name, fn)
        self.replaced = []


def use_torch_path(model):
    """Make a hybrid model's short conv and Gated DeltaNet run transformers' own torch code.

    transformers binds those calls at import time to causal-conv1d's / fla's functions when the
    packages are installed, and those take CUDA tensors only ("Expected x.is_cuda() to be true"), so
    a CPU forward of a Qwen3.5 dies on a machine that has them. The modeling module keeps its torch
    function under the wrapper (``__wrapped__``); this puts it back as the module global.

    Returns a :class:`TorchPath` (``undo()`` restores the previous globals), or None when the torch
    functions cannot be found this way (another transformers layout, or a model already routed
    elsewhere): route the model with ``dflash_kernels.integrations.transformers.use_dflash_kernels``
    then. A model without such layers gives an empty :class:`TorchPath`.
    """
    replaced = []
    for name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(name)
        if module is None:
            continue
        for fn_name in HYBRID_FUNCTIONS:
            current = getattr(module, fn_name, None)
            if current is None:
                continue
            torch_fn = inspect.unwrap(current)
            if getattr(torch_fn, "__module__", None) != name:  # not the modeling module's own code
                for m, n, fn in replaced:
                    setattr(m, n, fn)
                return None
            if torch_fn is not current:
                replaced.append((module, fn_name, current))
                setattr(module, fn_name, torch_fn)
    return TorchPath(replaced)
