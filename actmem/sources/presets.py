"""Model presets: one TOML file each, shipped in the wheel as actmem/presets/."""

import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from actmem.errors import SpecError
from actmem.model.hardware import GPUS
from actmem.sources.hf_config import is_hf_config, read_hf_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    source: str
    aliases: tuple
    model: dict
    run: dict
    architecture: dict
    """Optional [architecture] table (dropouts); the paper's GPT where absent."""
    notes: tuple = ()
    """What the estimate should repeat about how the file was read (a config.json's)."""
    seq_len_note: str = ""
    """Where s came from when the file only gives the longest context (a config.json)."""
    position_table: int | None = None
    """Rows of a learned position table the file fixes (gpt2's n_positions): s must equal it."""
    gpu: str | None = None
    """The GPU the preset's run was trained on (actmem.model.hardware's name): the default of --gpu."""
    unmeasured: dict = field(default_factory=dict)
    """{implementation: why its code for this model is not what the harness measured} (a
    config.json whose transformers class is not one of hf's): that --implementation refuses it."""


def preset_dir() -> Path:
    """Installed wheels carry actmem/presets/; a source checkout has presets/ at its root."""
    installed = resources.files("actmem") / "presets"
    if installed.is_dir():
        return Path(str(installed))
    return Path(__file__).resolve().parents[2] / "presets"


def all_presets() -> list[Preset]:
    """Smallest model first."""
    presets = [read_preset(path) for path in preset_dir().glob("*.toml")]
    return sorted(presets, key=lambda p: (p.model.get("hidden", 0), p.model.get("layers", 0), p.name))


def load_preset(name_or_path: str) -> Preset:
    """A shipped preset by name or alias (case-insensitive), or a TOML file by path."""
    path = Path(name_or_path)
    if is_hf_config(path):
        return Preset(**read_hf_config(path), description="a Hugging Face config.json", aliases=(), run={})
    if path.suffix == ".toml" or path.is_file():
        return read_preset(path)
    wanted = name_or_path.lower()
    presets = all_presets()
    for preset in presets:
        if wanted == preset.name or wanted in preset.aliases:
            return preset
    known = ", ".join(f"{p.name} ({', '.join(p.aliases)})" if p.aliases else p.name for p in presets)
    raise SpecError(f"unknown preset {name_or_path!r}; known: {known}; or give a path to a .toml file "
                    "or a Hugging Face config.json")


def read_preset(path: Path) -> Preset:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise SpecError(f"preset file {path}: cannot read it ({error.strerror})")
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise SpecError(f"preset file {path}: not valid TOML: {error}")
    unknown = sorted(set(data) - {"name", "description", "source", "aliases", "gpu", "model", "run", "architecture"})
    if unknown:
        raise SpecError(f"preset file {path}: unknown keys {', '.join(unknown)}")
    if not isinstance(data.get("model"), dict):
        raise SpecError(f"preset file {path}: needs a [model] table (heads, hidden, layers, vocab, seq_len)")
    for table in ("run", "architecture"):
        if not isinstance(data.get(table, {}), dict):
            raise SpecError(f"preset file {path}: [{table}] must be a table")
    aliases = data.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(alias, str) for alias in aliases):
        raise SpecError(f"preset file {path}: aliases must be a list of strings")
    gpu = data.get("gpu")
    if gpu is not None and str(gpu).lower() not in GPUS:
        raise SpecError(f"preset file {path}: gpu {gpu!r} is not one of {', '.join(GPUS)}")
    return Preset(name=str(data.get("name", path.stem)), description=str(data.get("description", "")),
                  source=str(data.get("source", str(path))), aliases=tuple(a.lower() for a in aliases),
                  model=data["model"], run=data.get("run", {}), architecture=data.get("architecture", {}),
                  gpu=None if gpu is None else str(gpu).lower())
