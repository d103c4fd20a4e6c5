"""Every stage of an uneven pipeline: which one holds the most.

With even stages the first holds the most (section 4.4: it has the most microbatches in
flight, and the embedding). An uneven pipeline moves layers off the first and last stages
(Llama 3: 7, then 8 on each stage between, then 7), so a stage after the first can hold
more: stage i runs min(p - i, n) microbatches at once under 1F1B. Each stage here is its
layers' activations at that count, its parameters, and on the last stage the output layer.
"""

from dataclasses import dataclass

from actmem import engine, symbols
from actmem.parameters import ParameterBytes, layer_parameters, parameter_bytes


@dataclass(frozen=True)
class StageLoad:
    stage: int
    layers: int
    microbatches: int
    """Microbatches in flight at the stage's peak (1F1B): min(p - i, n)."""
    activations_bytes: int
    parameters: ParameterBytes

    @property
    def total_bytes(self) -> int:
        return self.activations_bytes + self.parameters.total_bytes


def stage_layers(spec) -> list[int]:
    """Layers of each stage: the first and last as given, the rest shared evenly."""
    run, p = spec.run, spec.run.pipeline_parallel
    first, last = run.first_stage_layers, run.last_stage_layers
    middle_stages = p - (first is not None) - (last is not None)
    share = (spec.model.layers - (first or 0) - (last or 0)) // middle_stages if middle_stages else 0
    layers = [share] * p
    if first is not None:
        layers[0] = first
    if last is not None:
        layers[-1] = last
    return layers


def later_stages(spec, technique, per_layer_bytes: int, vocab: int) -> tuple:
    """Stages 1 to p-1 of an uneven pipeline (the first is the estimate itself)."""
    run, model, arch = spec.run, spec.model, spec.architecture
    p, t = run.pipeline_parallel, run.tensor_parallel
    n = spec.microbatches if spec.microbatches is not None else p
    bindings = spec.bindings() | {symbols.t: t, symbols.v: vocab}
    output = engine.exact(engine.extra_bytes(technique, 0, 1, arch), bindings)
    per_layer_parameters = layer_parameters(model.hidden, t, arch, model.heads)
    head = arch.norm_parameters * model.hidden + vocab * model.hidden // t   # tied: a copy of the embedding
    loads = []
    for stage, layers in enumerate(stage_layers(spec)[1:], start=1):
        held = min(p - stage, n)
        last = stage == p - 1
        count = layers * per_layer_parameters + last * head
        loads.append(StageLoad(stage, layers, held, layers * held * per_layer_bytes + last * output,
                               parameter_bytes(count, spec.optimizer_shards, run.distributed_optimizer)))
    return tuple(loads)
