"""Which configurations to measure: from a spec and a list of techniques, or a named grid."""

from actmem.presets import load_preset
from actmem.spec import Spec
from actmem_validate.measure import TECHNIQUES, Config

DEFAULT_TECHNIQUES = ("tp", "tp-sp", "tp-sel", "tp-sp-sel", "full", "tp-sp-full")


def filling_microbatches(p: int, m: int) -> int:
    """The fewest microbatches that fill the schedule: p for 1F1B; 2p interleaved (n must be
    a multiple of p, and n = p never reaches the steady state)."""
    return p if m == 1 else 2 * p


def configs_for(spec: Spec, techniques, microbatches: int | None = None, dropout: float = 0.1) -> list[Config]:
    run, model = spec.run, spec.model
    n = microbatches or filling_microbatches(run.pipeline_parallel, run.interleave)
    return [Config(spec.name, technique, model.heads, model.hidden, model.layers, model.vocab,
                   model.seq_len, run.tensor_parallel, run.pipeline_parallel, run.interleave,
                   run.micro_batch, n, dropout) for technique in techniques]


def small_grid() -> list[Config]:
    """Small shapes a 2-core CPU runs for real in minutes: t = 1, 2, 4; SP on and off; the
    three recompute modes; 1F1B and interleaved; and the output layer (p = 1)."""
    shapes = dict(heads=8, hidden=64, vocab=512, seq_len=32, micro_batch=2)
    configs = []
    for t in (2, 4):
        for technique in DEFAULT_TECHNIQUES:
            configs.append(Config("small", technique, layers=2, t=t, p=1, m=1, microbatches=1, **shapes))
        for technique, p, m in (("tp-sp-sel", 2, 1), ("tp-sel", 2, 2), ("tp-sp", 2, 2), ("tp-sp-full", 4, 1)):
            configs.append(Config("small", technique, layers=4, t=t, p=p, m=m,
                                  microbatches=filling_microbatches(p, m), **shapes))
    configs.append(Config("small", "none", layers=2, t=1, p=1, m=1, microbatches=1, **shapes))
    configs.append(Config("small", "none", layers=4, t=1, p=2, m=2, microbatches=4, **shapes))
    return configs


def preset_grid(names=("22b", "175b", "530b", "1t"), techniques=("tp", "tp-sp-sel")) -> list[Config]:
    """The paper's Table 3 models at full scale, for fake mode: the baseline and the paper's run."""
    from actmem.spec import build_spec

    configs = []
    for name in names:
        preset = load_preset(name)
        configs += configs_for(build_spec(preset.model, preset.run, name=preset.name), techniques)
    return configs


GRIDS = {"small": small_grid, "presets": preset_grid}
assert set(DEFAULT_TECHNIQUES) <= set(TECHNIQUES)
