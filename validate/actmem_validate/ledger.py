"""Which tensors the forward pass saves for the backward pass, by term, deduplicated.

``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd saves. Each
storage is counted once (a view saved twice holds its memory once), parameters are left
out, and each is attributed to the term name the layer code gave its storage with
``label``, else to the enclosing ``scope`` (tensors an op saves internally, such as the
layer-norm statistics), else to ``unattributed``, so nothing is hidden.

Checkpointed regions (selective and full recompute) show the ledger only their inputs,
whichever way torch checkpoints: with ``use_reentrant=True`` (Megatron's own
CheckpointFunction, which the harness uses) the region runs under no_grad and
CheckpointFunction saves its inputs; with ``use_reentrant=False`` torch saves the inputs
as saved tensors of its frame (torch 2.13: _CheckpointFrame.save_inputs; 2.11: a no-op
Function) and hides the region's saves behind its own saved_tensors_hooks, which take
precedence over the ledger's. The ledger's count is therefore the same in both
modes (tests/validate/test_schedule_and_ledger.py checks it).
"""

import weakref
from contextlib import contextmanager

import torch

from actmem_validate.torch_compat import local_tensor, storage_key

UNATTRIBUTED = "unattributed"
_active: list = []


def label(tensor: torch.Tensor, term: str) -> torch.Tensor:
    """Name the storage of a tensor after a term of actmem's table, before it is saved (an
    op that saves its own output, like softmax, runs inside ``scope`` instead). The first
    live name sticks (the full-recompute checkpoint names the layer input before the layer
    does); a name whose storage has died no longer holds, since its address may be reused.
    The weakref is on the storage, which torch keeps one Python object for while it lives,
    not on the tensor: a view made inside an op (a linear's flattened input) dies at once."""
    for ledger in _active:
        key = storage_key(tensor)
        held = ledger.names.get(key)
        if held is None or held[1]() is None:
            ledger.names[key] = (term, weakref.ref(local_tensor(tensor).untyped_storage()))
    return tensor


def name_of(tensor: torch.Tensor) -> str:
    """The term a live tensor's storage was labelled with (unattributed if none)."""
    for ledger in _active:
        held = ledger.names.get(storage_key(tensor))
        if held is not None and held[1]() is not None:
            return held[0]
    return UNATTRIBUTED


def name_saved_output(tensor: torch.Tensor, term: str) -> torch.Tensor:
    """Name an output that the op which made it has already saved inside a ``scope``: an op
    that saves two of its own outputs (flash attention: out and the log-sum-exp) runs in the
    scope of one, and the other is named after the op. Only a storage the scope filed moves."""
    for ledger in _active:
        ledger.name_saved_output(storage_key(tensor), term)
    return label(tensor, term)


def record(tensor: torch.Tensor) -> None:
    """File a tensor autograd saves under an inner saved_tensors_hooks pair, which hides it from
    the ledger's own (torch calls only the innermost pair): CPU offloading's (offload.py)."""
    for ledger in _active:
        ledger.pack(tensor)


@contextmanager
def scope(term: str):
    """Attribute what the ops inside save, and nobody labelled, to this term."""
    for ledger in _active:
        ledger.scopes.append(term)
    try:
        yield
    finally:
        for ledger in _active:
            ledger.scopes.pop()


class Ledger:
    """Saved bytes by term for one forward pass."""

    def __init__(self, model_state):
        """model_state: parameters and buffers (the causal mask, say): not activations."""
        self.excluded = {storage_key(p) for p in model_state}
        self.names: dict = {}
        self.scopes: list = []
        self.saved: dict = {}        # storage key -> (term, bytes)
        self.storages: dict = {}     # storage key -> a weak reference to the storage, to see it freed
        self.by_scope: set = set()   # keys filed under a scope, not a label

    def name_saved_output(self, key, term: str) -> None:
        """An op that saves two of its own outputs (flash attention: out and the
        log-sum-exp) runs inside one scope; labelling one output after the op moves it from
        the scope's name to its own. Only a storage the scope filed moves."""
        if key in self.by_scope:
            self.saved[key] = (term, self.saved[key][1])
            self.by_scope.discard(key)

    def pack(self, tensor):
        """The pack hook: file a saved tensor's storage under its term (once a storage)."""
        key = storage_key(tensor)
        held = self.storages.get(key)
        if held is not None and held() is None:          # a node autograd freed lent its storage's address
            self.saved.pop(key, None)
            self.by_scope.discard(key)
        if local_tensor(tensor).untyped_storage().nbytes() == 0:
            return tensor     # holds nothing (torch 2.11's non-reentrant checkpoint saves a
                              # torch.empty((0,)) beside its inputs: _NoopSaveInputs)
        if key not in self.excluded and key not in self.saved:
            fallback = self.scopes[-1] if self.scopes else UNATTRIBUTED
            term, alive = self.names.get(key, (fallback, None))
            if alive is not None and alive() is None:   # a freed tensor's storage was reused
                term = fallback
            storage = local_tensor(tensor).untyped_storage()
            self.saved[key] = (term, storage.nbytes())
            self.storages[key] = weakref.ref(storage)
            if term == fallback:
                self.by_scope.add(key)
        return tensor

    def drop_freed(self) -> None:
        """Forget what autograd has freed since it was saved (a branch of the graph nothing uses):
        only storages still alive are held."""
        for key in [key for key, alive in self.storages.items() if alive() is None and key in self.saved]:
            del self.saved[key]
            self.by_scope.discard(key)

    @contextmanager
    def recording(self):
        _active.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor):
                yield self
        finally:
            _active.remove(self)

    def by_term(self) -> dict:
        totals: dict = {}
        for term, n_bytes in self.saved.values():
            totals[term] = totals.get(term, 0) + n_bytes
        return totals
