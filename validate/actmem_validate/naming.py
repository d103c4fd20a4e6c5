"""Name saved tensors after actmem's terms in code the harness cannot label: a rule names
the tensors an aten op makes or takes, in a module, and the ledger files their storages
under that name (hf.py: transformers' model; torch_native.py: torchtitan's loss).

A rule is (module name ends with these whole names, aten op, which of its tensors, term),
the op as 'mm.default', or 'bmm.default#1' for its second call in that module; which: 'in'
its tensor inputs, an index into them, 'out' its outputs, 'out:dtype' those of a dtype,
'outN' the N-th. Every matching rule names; the first name a storage gets sticks. Autograd saves an
op's inputs before the op runs, so a rule on inputs re-files what was just saved unnamed
(ledger.name_saved_output), never a storage already named.
"""

from contextlib import contextmanager

import torch

from actmem_validate.ledger import name_saved_output


@contextmanager
def naming(model, rules):
    """Apply ``rules`` while the model runs: module hooks keep the running module's name, a
    dispatch mode sees each op (above DTensor's: its ops and their DTensor arguments)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    names = {module: name for name, module in model.named_modules()}
    stack, counts = [""], {}          # counts: (module, op) -> calls so far (each layer is a module)

    def enter(module, args):
        stack.append(names.get(module, stack[-1]))

    def leave(module, args, out):
        stack.pop()

    class _Rules(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            op = str(func).split(".", 1)[-1]          # aten.mm.default -> mm.default
            key = (stack[-1], op)
            counts[key] = counts.get(key, -1) + 1
            inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            outputs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
            for tensor, term in _named(rules, stack[-1], op, counts[key], inputs, outputs):
                name_saved_output(tensor, term)     # autograd saves an op's inputs before it runs
            return out

    handles = [torch.nn.modules.module.register_module_forward_pre_hook(enter),
               torch.nn.modules.module.register_module_forward_hook(leave)]
    try:
        with _Rules():
            yield
    finally:
        for handle in handles:
            handle.remove()


def _named(rules, module: str, op: str, nth: int, inputs: list, outputs: list) -> list:
    """(tensor, term) for what every matching rule names in this op."""
    named = []
    for suffix, rule_op, what, term in rules:
        name, _, index = rule_op.partition("#")
        if name == op and (not index or int(index) == nth) and _module_matches(module, suffix):
            named += [(tensor, term) for tensor in _picked(what, inputs, outputs)]
    return named


def _picked(what, inputs: list, outputs: list) -> list:
    if what == "in":
        return inputs
    if isinstance(what, int):
        return [inputs[what]]
    if what.startswith("out:"):
        return [t for t in outputs if t.dtype == getattr(torch, what[4:])]
    return [outputs[int(what[3:])]] if what[3:] else outputs


def _module_matches(module: str, suffix: str) -> bool:
    """'' is the root module (a loss computed outside any other); a name matches whole
    trailing names ('mlp.act' is transformer.h.0.mlp.act; 'attn' is not attn.c_attn)."""
    if suffix == "":
        return module == ""
    return module == suffix or module.endswith("." + suffix)
