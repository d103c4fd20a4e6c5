"""actmem's parameter count per GPU equals the parameters of the stage the harness builds,
the way Megatron splits them (counted with numel, not with actmem's formula)."""

import pytest

torch = pytest.importorskip("torch")

from actmem.memory.estimate import estimate  # noqa: E402
from actmem.sources.presets import load_preset  # noqa: E402
from actmem.model.spec import build_spec  # noqa: E402
from actmem_validate.gpt import LayerSpec  # noqa: E402
from actmem_validate.parallel import TensorParallel  # noqa: E402
from actmem_validate.schedule import FirstStage  # noqa: E402
from actmem_validate.torch_compat import fake_tensor_mode  # noqa: E402


@pytest.mark.parametrize("name, t", [("22b", 8), ("22b", 1), ("530b", 8), ("175b", 4), ("llama-3.1-405b", 8),
                                     ("llama-3.1-8b", 1)])
def test_first_stage_parameters_equal_the_built_stage(name, t):
    preset = load_preset(name)
    run = {"tensor_parallel": t, "gpus": None, "global_batch": None, "distributed_optimizer": False,
           "sequence_parallel": t > 1}
    spec = build_spec(preset.model, preset.run | run, architecture=preset.architecture)
    run = spec.run
    with fake_tensor_mode():                       # paper scale, no memory
        stage = FirstStage(LayerSpec.of(spec), spec.padded_vocab, TensorParallel(size=t),
                           run.pipeline_parallel, run.interleave, spec.stage_layers)
        built = sum(param.numel() for param in stage.parameters())
    assert estimate(spec).parameters.count == built


def test_a_learned_position_table_longer_than_s_is_built_and_counted_alike():
    """22B at s = 2048 with --max-position-embeddings 4096: the built table has 4,096 rows, and
    actmem counts them: 2,048 x 6,144 = 12,582,912 parameters more than at s rows."""
    preset = load_preset("22b")
    counts = []
    for rows in (None, 4096):
        spec = build_spec(preset.model, preset.run | {"gpus": None, "global_batch": None},
                          architecture=preset.architecture | {"position_rows": rows})
        with fake_tensor_mode():
            stage = FirstStage(LayerSpec.of(spec), spec.padded_vocab, TensorParallel(size=8),
                               spec.run.pipeline_parallel, spec.run.interleave, spec.stage_layers)
            built = sum(param.numel() for param in stage.parameters())
        assert estimate(spec).parameters.count == built
        counts.append(built)
    assert counts[1] - counts[0] == 2048 * 6144 == 12_582_912
