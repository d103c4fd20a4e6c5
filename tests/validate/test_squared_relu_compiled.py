"""Megatron runs squared_relu under its jit_fuser, torch.compile (megatron/core/jit.py), whose
backward graph keeps what AOTAutograd's min-cut partitioner chooses (Inductor's
partition_fn). The harness runs it eager (relu saves its output, which pow reuses); this test
runs the same function through the partitioner torch.compile uses, with no code generation
(a CPU machine may lack a C++ compiler), and sees it keep the same bytes: one tensor of the
input's shape and dtype."""

import pytest

torch = pytest.importorskip("torch")

from functorch.compile import aot_function, min_cut_rematerialization_partition, nop  # noqa: E402


def squared_relu(x):
    """megatron/core/activations.py, as written there."""
    return torch.pow(torch.nn.functional.relu(x), 2)


@pytest.mark.parametrize("partition", [min_cut_rematerialization_partition, None])
def test_squared_relu_keeps_one_tensor_of_its_input_s_shape(partition):
    run = squared_relu if partition is None else aot_function(
        squared_relu, fw_compiler=nop, bw_compiler=nop, partition_fn=partition)
    x = torch.randn(32, 2, 48, dtype=torch.bfloat16, requires_grad=True)
    hidden = x * 1                                      # fc1's output, not a leaf
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = (tuple(tensor.shape), tensor.dtype, storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = run(hidden)
    assert list(saved.values()) == [((32, 2, 48), torch.bfloat16, 32 * 2 * 48 * 2)]
    y.sum().backward()
    expected = 2 * torch.relu(x.detach().float())
    assert torch.allclose(x.grad.float(), expected.to(torch.bfloat16).float(), rtol=1e-2)
