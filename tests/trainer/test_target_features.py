"""Target.features stops after the deepest layer it needs, gives the same bits as the whole forward's
hidden states, and keeps threads that share one target apart."""

import threading

import pytest
import torch

from tests.helpers import slow_param
from trainer.target import Target, load_target


def _whole_forward_features(target, ids):
    out = target.model.base_model(input_ids=ids, output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[i + 1] for i in target.layer_ids], -1)


def _ids(target, seed, B=2, T=37):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, target.vocab_size, (B, T), generator=g)


@pytest.mark.parametrize("model_dir", ["tiny_qwen35_dir", "tiny_qwen3_dir"])
def test_features_stop_early_and_equal_the_whole_forward(model_dir, request):
    target = load_target(request.getfixturevalue(model_dir), layer_ids=[0, 2], use_kernels=False)
    assert target._tapped and target.num_layers > 3
    ran = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: ran.append(i))
             for i, layer in enumerate(target.model.base_model.layers)]
    ids = _ids(target, 0)
    target.features(_ids(target, 9))  # a shape's first call also checks the ready-made mask mapping
    ran.clear()
    got = target.features(ids)
    assert ran == [0, 1, 2], f"layers run by features(): {ran}"  # none past the deepest needed one
    ran.clear()
    want = _whole_forward_features(target, ids)
    assert ran == list(range(target.num_layers))
    for h in hooks:
        h.remove()
    assert got.shape == want.shape and torch.equal(got, want)


def test_the_last_layer_keeps_the_whole_forward(tiny_qwen35_dir):
    # HF's hidden_states[-1] is the final-normed state: with the last layer asked for, features() runs
    # the whole forward and returns exactly that, as before.
    target = load_target(tiny_qwen35_dir, layer_ids=[1, 3], use_kernels=False)
    assert not target._tapped
    ids = _ids(target, 1)
    assert torch.equal(target.features(ids), _whole_forward_features(target, ids))


def test_threads_sharing_a_target_get_their_own_features(tiny_qwen35_dir):
    target = load_target(tiny_qwen35_dir, layer_ids=[0, 1], use_kernels=False)
    inputs = [_ids(target, s) for s in range(6)]
    want = [target.features(x) for x in inputs]
    got = [None] * len(inputs)
    start = threading.Barrier(len(inputs))

    def work(j):
        start.wait()
        for _ in range(3):
            got[j] = target.features(inputs[j])

    threads = [threading.Thread(target=work, args=(j,)) for j in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    # outside features() the taps do nothing: the model's own forward and logits are untouched
    logits, feats = target.logits_and_features(inputs[0])
    assert torch.equal(feats, _whole_forward_features(target, inputs[0])) and logits.shape[-1] == target.vocab_size


@pytest.mark.slow
def test_a_second_target_on_the_same_model_is_independent(tiny_qwen35_dir):
    first = load_target(tiny_qwen35_dir, layer_ids=[0, 2], use_kernels=False)
    second = Target(first.model, first.tokenizer, [1])
    ids = _ids(first, 2)
    assert torch.equal(second.features(ids), _whole_forward_features(second, ids))
    assert torch.equal(first.features(ids), _whole_forward_features(first, ids))


@pytest.mark.parametrize("model_dir", [slow_param("tiny_qwen35_dir"), "tiny_qwen3_dir"])
def test_the_ready_made_mask_mapping_is_checked_once_per_shape(model_dir, request):
    """features() passes transformers the attention-mask mapping it would build itself (so the forward has
    no packed-sequence check, a host synchronization), only after the first call of a shape found the
    features bit-identical both ways; a model where they differ keeps its own masks."""
    from tools.audits import sync_audit as sa

    target = load_target(request.getfixturevalue(model_dir), layer_ids=[0, 2], use_kernels=False)
    ids = _ids(target, 0)
    want = _whole_forward_features(target, ids)
    assert torch.equal(target.features(ids), want)
    assert target._no_masks == {(tuple(ids.shape), ids.device): True}
    logger = sa.SyncLogger()
    with logger:
        got = target.features(_ids(target, 1))
    assert not logger.points, [p.where() for p in logger.points]
    assert torch.equal(got, _whole_forward_features(target, _ids(target, 1)))
    with logger:
        _whole_forward_features(target, ids)  # transformers' own path does synchronize
    assert logger.points
    target._no_masks.clear()
    real = target._features
    target._features = lambda x, kw: real(x, kw) + (1 if kw else 0)  # the mapping changes the result
    target.features(ids)
    assert target._no_masks == {(tuple(ids.shape), ids.device): False}
