"""One differentiable op, two entry points: a ``torch.library.custom_op`` for ``torch.compile`` and a
plain ``torch.autograd.Function`` for eager calls.

Why both: the custom op is what lets a user's ``torch.compile`` trace an op without a graph break,
but its Python dispatch costs tens of microseconds per call, more than twice what an
``autograd.Function`` around the same body costs. Eager callers, the common case in a training loop,
take the cheap path, and a call with nothing to differentiate (grad mode off, or no input that
requires grad: a frozen target's forward) runs the implementation alone, without an autograd node;
while a tracer runs (dynamo, AOT autograd tracing a compiled backward, make_fx, export), the custom
op is used.
Both run the same implementation, ``setup_context`` and ``backward``, with the same semantics (a
custom op's autograd is itself an ``autograd.Function`` with materialized gradients).
"""

import torch

__all__ = ["differentiable_op", "eager_call", "traced"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def traced(args) -> bool:
    """True while a tracer sees these arguments (dynamo; AOT autograd tracing a compiled backward;
    make_fx / export): fake, functional or proxied tensors, which have no data for a kernel, or a
    dispatch mode that records the ops. Then the custom op runs, which the tracer knows how to treat."""
    # is_compiling first: dynamo reads it as True and stops there (it cannot trace the stack's length)
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return True
    for a in args:  # a traced call's tensors are all of the tracer's kind: the first one tells
        if isinstance(a, torch.Tensor):
            return type(a) not in _PLAIN
    return False


def differentiable_op(custom_op, impl, setup_context, backward):
    """Register ``backward`` / ``setup_context`` on ``custom_op`` and return ``call(*inputs)``.

    Args:
        custom_op: the ``torch.library.custom_op`` whose implementation is ``impl``.
        impl: the plain function behind it, ``impl(*inputs) -> output``.
        setup_context: ``setup_context(ctx, inputs, output)``, as for ``register_autograd``.
        backward: ``backward(ctx, *grads) -> one gradient (or None) per input``.
    """
    custom_op.register_autograd(backward, setup_context=setup_context)

    class _Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            output = impl(*inputs)
            setup_context(ctx, inputs, output)
            return output

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

    _Eager.__name__ = f"{getattr(impl, '__name__', 'op')}_eager"

    def call(*inputs):
        if traced(inputs):
            return custom_op(*inputs)
        if not torch.is_grad_enabled() or not any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
            return impl(*inputs)  # nothing to differentiate (a frozen target's forward): no autograd node
        return _Eager.apply(*inputs)

    return call


def eager_call(custom_op):
    """``custom_op`` (a ``torch.library.custom_op``) as a callable that runs its Python function directly
    outside ``torch.compile`` and the op inside it: the backward passes call their kernels' launchers
    this way, without the dispatcher's per-call host cost, which a short kernel cannot hide."""
    fn = getattr(custom_op, "_init_fn", None)
    if fn is None:  # a torch without the attribute: always the op
        return custom_op

    def call(*args):
        if traced(args):
            return custom_op(*args)
        return fn(*args)
    return call
