"""The harness's dummy weight gradients, as TE's get_dummy_wgrad keeps them: one a weight
shape, handed to autograd by every linear that accumulated into main_grad, dropped by
DDP's hook, and zeroed for the word embedding tied to the output layer."""

import pytest

torch = pytest.importorskip("torch")

from actmem_validate import layers  # noqa: E402
from actmem_validate.parallel import TensorParallel  # noqa: E402


@pytest.fixture(autouse=True)
def empty_cache():
    layers.make_dummy_wgrads([])
    yield
    layers.make_dummy_wgrads([])


def test_one_dummy_a_weight_shape_as_te_caches_them():
    """Two weights of one shape share a dummy; a third shape has its own; the dummy handed
    out is a new tensor on the cached storage (AccumulateGrad takes it over, no copy)."""
    a, b = torch.nn.Parameter(torch.ones(4, 8)), torch.nn.Parameter(torch.ones(4, 8))
    c = torch.nn.Parameter(torch.ones(8, 4))
    layers.make_dummy_wgrads([a, b, c])
    assert len(layers._DUMMY_WGRADS) == 2
    first, second = layers.dummy_wgrad(a), layers.dummy_wgrad(b)
    assert first is not second and first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    assert layers.dummy_wgrad(c).shape == (8, 4)


def test_a_dummy_is_dropped_and_the_gradient_is_main_grad_s():
    """The linear accumulates into main_grad and hands autograd its dummy, uncomputed (here
    filled with 1000 to stand for whatever memory held): DDP's hook drops it, and main_grad
    holds x^T·grad alone."""
    weight = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.float64))
    layers.attach_main_grads(torch.nn.ParameterList([weight]))
    layers.make_dummy_wgrads([weight])
    layers.dummy_wgrad(weight).fill_(1000)
    x, grad = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    layers.linear(x, weight, None, TensorParallel()).backward(grad)
    assert weight.grad is None
    assert torch.allclose(weight.main_grad.double(), grad.t() @ x, atol=1e-5)


def test_the_tied_embedding_s_dummy_is_zeroed():
    """At p = 1 the output layer and the word embedding share one weight: autograd adds the
    output layer's dummy to the embedding's real gradient before DDP's hook sees it, so the
    dummy must be zero (Megatron marks the shared weight zero_out_wgrad). With the dummy
    left at 1000, main_grad would be off by 1000 everywhere."""
    torch.manual_seed(0)
    words = torch.nn.Parameter(torch.randn(5, 4, dtype=torch.float64))
    x = torch.randn(6, 4, dtype=torch.float64)
    tokens, grad = torch.tensor([0, 2, 2, 4]), torch.randn(6, 5, dtype=torch.float64)

    def step():
        embedded = torch.nn.functional.embedding(tokens, words)
        logits = layers.linear(x, words, None, TensorParallel())
        (embedded.sum() + (logits * grad).sum()).backward()

    step()
    expected, words.grad = words.grad.clone(), None          # autograd's own, no main_grad
    layers.attach_main_grads(torch.nn.ParameterList([words]))
    words.zero_out_wgrad = True
    layers.make_dummy_wgrads([words])
    layers._DUMMY_WGRADS[next(iter(layers._DUMMY_WGRADS))].fill_(1000)
    step()
    assert words.grad is None
    assert torch.allclose(words.main_grad.double(), expected, atol=1e-5)
