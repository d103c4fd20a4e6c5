"""`actmem plot`: the data behind each picture (its frame is the CSV a user can get, with
numbers from the paper), and the files (valid PNG or SVG of the size asked for). The frame
tests run without matplotlib; the drawing tests skip cleanly when it is missing."""

import io
import struct
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from types import SimpleNamespace

import pandas as pd
import pytest
from click.testing import CliRunner

from actmem.cli.plot_cli import plot
from actmem.views.plot_frames import MEMORY_PARTS, VALIDATION_COLUMNS
from tests.conftest import assert_one_line_error

GIB = 2**30
PLAN_530B = ("--model", "530b", "--gpus", "2240", "--global-batch", "2240")


def run_plot(*args):
    return CliRunner().invoke(plot, list(args), prog_name="actmem plot")


def frame_written(tmp_path, *args) -> pd.DataFrame:
    """What `actmem plot ... --csv` writes, parsed."""
    path = tmp_path / "frame.csv"
    result = run_plot(*args, "--csv", str(path))
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == f"actmem plot: wrote {path}"   # then what a sweep left out
    return pd.read_csv(path)


def csv_section(actmem, section: str, *args) -> pd.DataFrame:
    """One section of `actmem estimate --format csv`, its own columns only."""
    result = actmem("estimate", *args, "--format", "csv")
    assert result.exit_code == 0, result.output
    table = pd.read_csv(io.StringIO(result.stdout))
    return table[table.section == section].dropna(axis=1, how="all").reset_index(drop=True)


# -- where the memory goes -----------------------------------------------------------------

def test_memory_frame_is_the_csv_and_its_bars_are_the_estimates_techniques(tmp_path, actmem):
    """530B (t=8, p=35, m=3, s=2048, b=1): the bars are the technique rows of
    `estimate --format csv`, peak and verdict included; the parameter parts add up to its
    parameters_bytes, and the parts of a bar to its peak."""
    from actmem.views.plot_frames import memory_frame
    from actmem.sources.presets import load_preset
    from actmem.model.spec import build_spec

    preset = load_preset("530b")
    frame = memory_frame(build_spec(preset.model, preset.run, name=preset.name))
    pd.testing.assert_frame_equal(frame_written(tmp_path, "memory", "--model", "530b"), frame)
    techniques = csv_section(actmem, "techniques", "--model", "530b")
    shared = ["technique", "label", "is_run", "per_layer_bytes", "layers_bytes", "extra_bytes", "total_bytes",
              "peak_bytes", "fits"]
    pd.testing.assert_frame_equal(frame[shared], techniques[shared], check_dtype=False)
    state = frame.weights_bytes + frame.gradients_bytes + frame.optimizer_bytes + frame.dummy_wgrads_bytes
    assert list(state) == list(techniques.parameters_bytes)
    assert list(frame[list(MEMORY_PARTS)].sum(axis=1)) == list(frame.peak_bytes)


@pytest.mark.parametrize("run, architecture", [
    (dict(gpus=8, fsdp=True), {"implementation": "torch-native"}),
    (dict(gpus=8, zero_stage=1), {"implementation": "hf"}),
    (dict(gpus=8, zero_stage=3), {"implementation": "hf"}),
])
def test_sharded_runs_stack_their_gradients_where_the_peak_holds_them(run, architecture):
    """FSDP2's and ZeRO-1's gradients are held at some moments only: the bar stacks them in its part at the peak,
    not as gradients held throughout, so its parts still add up to the peak floor; ZeRO-3 keeps its gradient
    partition and bucket throughout, a part of their own."""
    from actmem.views.plot_frames import memory_frame
    from actmem.sources.presets import load_preset
    from actmem.model.spec import build_spec
    from actmem.memory.estimate import estimate

    preset = load_preset("llama-3.1-8b")
    spec = build_spec(preset.model | {"seq_len": 4096}, run, architecture=preset.architecture | architecture)
    frame = memory_frame(spec)
    assert list(frame[list(MEMORY_PARTS)].sum(axis=1)) == list(frame.peak_bytes)
    held = estimate(spec).run_row.parameters
    assert frame.gradients_bytes.iloc[-1] == (held.gradients_bytes if run.get("zero_stage") == 3 else 0)


def test_memory_bars_by_hand_for_530b(tmp_path):
    """Eq 6 per layer 34sbh/t, held over L(1 + (p-1)/(pm)) = 105(1 + 34/105) = 139 layers
    (section 4.4's interleave factor); the rerun on top: selective, the attention
    core 5as²b/t and its output again 2sbh/t, less the 24sbh/t the last layer freed first, then
    its backward: the dropout output 2as²b/t freed, 2 x 2as²b/t and 3 x 2sbh/t of gradients;
    full (t = 8, no SP), the layer without recompute sbh(10 + 24/t + 5as/ht) = 21sbh less its
    2sbh checkpoint, with its output made again (2sbh), then its fc1 backward: GeLU's input
    gradient 2sbf/t = sbh, fc1's input gradient 2sbh and the gradient at the layer's output
    2sbh made, GeLU's and fc2's inputs (sbh each) and the mask sbh freed: 21sbh + 5sbh - 3sbh
    = 23sbh; tp, nothing rerun, its fc1 backward alone: 5sbh - 3sbh = 2sbh."""
    frame = frame_written(tmp_path, "memory", "--model", "530b").set_index("technique")
    s, b, h, a, t = 2048, 1, 20480, 128, 8
    sbh = s * b * h
    assert frame.loc["tp-sp-sel", "layers_bytes"] == 34 * sbh // t * (105 + 34)
    assert frame.loc["tp-sp-sel", "transient_bytes"] == (5 * a * s * s * b // t + 2 * sbh // t - 24 * sbh // t
                                                         - 2 * a * s * s * b // t + 4 * a * s * s * b // t
                                                         + 6 * sbh // t)
    assert frame.loc["full", "transient_bytes"] == 21 * sbh - 2 * sbh + 2 * sbh + 5 * sbh - 3 * sbh
    assert frame.loc["tp", "transient_bytes"] == 5 * sbh - 3 * sbh
    assert bool(frame.loc["tp-sp-sel", "is_run"]) and frame.is_run.sum() == 1


# -- how it grows ----------------------------------------------------------------------------

def test_growth_marks_where_the_s_squared_terms_overtake_the_rest(tmp_path):
    """22B (h=6144, a=64, t=8), no recompute. Per layer, 5as²b against 34sbh with nothing
    split by t or everything split by it (none, tp-sp): s = 34h/5a = 34·6144/320 = 652.8.
    Plain TP splits the s² terms and 24 of the 34: 5as²b/t against sbh(10 + 24/t), so
    s = h(10t + 24)/5a = 6144·104/320 = 1996.8. Recompute drops the s² terms: no crossing."""
    frame = frame_written(tmp_path, "growth", "--model", "22b", "--recompute", "none")
    crossing = frame.groupby("technique").attention_overtakes_seq_len.first()
    assert crossing["none"] == pytest.approx(652.8, abs=1e-9)
    assert crossing["tp-sp"] == pytest.approx(652.8, abs=1e-9)
    assert crossing["tp"] == pytest.approx(1996.8, abs=1e-9)
    assert crossing[["tp-sel", "tp-sp-sel", "full", "tp-sp-full"]].isna().all()
    s, b, a, t = 2048, 4, 64, 8
    tp = frame[(frame.technique == "tp") & (frame.seq_len == s)].iloc[0]
    assert tp.attention_s2_per_layer_bytes == 5 * a * s * s * b // t
    assert tp.other_per_layer_bytes == s * b * 6144 * (10 + 24 // t)


def test_a_flash_moe_layer_has_no_s_squared_bytes():
    """Mixtral 8x7B (a flash core: no scores kept): no row of its layer grows with s², though its expert rows hold
    a ceiling of s and a floor under FP8, whose second derivative sympy leaves standing (771,768,320 B a layer
    were once called quadratic)."""
    from actmem.memory.techniques import TECHNIQUES
    from actmem.model.spec import build_spec
    from actmem.sources.presets import load_preset
    from actmem.views.plot_frames import _s_squared_per_layer_bytes

    preset = load_preset("mixtral-8x7b")
    for architecture in (preset.architecture, preset.architecture | {"fp8_format": "e4m3", "fp8_recipe": "tensorwise"}):
        spec = build_spec(preset.model, preset.run, architecture=architecture, name=preset.name, gpu_name="h100",
                          gpu_fp8="hopper")
        assert [_s_squared_per_layer_bytes(spec, technique) for technique in TECHNIQUES] == [0] * len(TECHNIQUES)


def test_growth_frame_is_the_csv_and_meets_the_estimate_at_the_models_s(tmp_path):
    from actmem.views.plot_frames import growth_frame, memory_frame
    from actmem.sources.presets import load_preset
    from actmem.model.spec import build_spec

    preset = load_preset("22b")
    spec = build_spec(preset.model, preset.run, name=preset.name)
    frame = growth_frame(spec, "seq_len", [1024, 2048, 4096])
    written = frame_written(tmp_path, "growth", "--model", "22b", "--values", "4096,1024,2048")
    pd.testing.assert_frame_equal(written, frame)
    at_2048 = (frame[frame.seq_len == 2048].drop(columns=["attention_overtakes_seq_len", "first_over_gpu"])
               .reset_index(drop=True))
    pd.testing.assert_frame_equal(at_2048, memory_frame(spec))


def test_growth_over_the_microbatch(tmp_path):
    """22B's run has global batch 4 on one data-parallel rank: b can be 1, 2 or 4."""
    frame = frame_written(tmp_path, "growth", "--model", "22b", "--over", "micro-batch")
    assert sorted(frame.micro_batch.unique()) == [1, 2, 4]
    said = run_plot("growth", "--model", "22b", "--over", "micro-batch", "--csv", str(tmp_path / "b.csv"))
    assert said.stdout.splitlines()[1] == ("left out micro-batch = 8, 16, which the run refuses; at 8: "
                                           "micro_batch·data_parallel (8·1 = 8) must divide global_batch (4)")
    assert frame.attention_overtakes_seq_len.isna().all()


def test_growth_over_the_microbatch_from_a_run_refused_at_b_1(tmp_path):
    """6 heads at t = 1, s = 512, the eager core, p = 3 with the dataloader's mask: Megatron's
    fused softmax needs b·a/t a multiple of 4, so at b = 1 (6) torch's fallback runs, and beside
    the dataloader's mask the stage between makes masks of its own, which actmem refuses; b = 2,
    4, 8, 16 (12 ... 96) run the kernel. The sweep starts from the model's dims, not from a run
    at b = 1, and says what it left out."""
    dims = ("--heads", "6", "--hidden", "384", "--layers", "3", "--pp", "3", "--vocab", "512", "--seq-len", "512",
            "--global-batch", "16", "--attention-mask")
    frame = frame_written(tmp_path, "growth", *dims, "--over", "micro-batch")
    assert sorted(frame.micro_batch.unique()) == [2, 4, 8, 16]
    said = run_plot("growth", *dims, "--over", "micro-batch", "--csv", str(tmp_path / "b.csv"))
    assert said.stdout.splitlines()[1].startswith("left out micro-batch = 1, which the run refuses")
    assert "the layers that mask does not reach" in said.stdout
    assert_one_line_error(run_plot("growth", *dims, "--over", "micro-batch", "--values", "1,2",
                                   "--csv", str(tmp_path / "c.csv")), "micro_batch = 1",
                          "the layers that mask does not reach")


def test_a_sweep_value_the_run_refuses_is_one_line(tmp_path):
    result = run_plot("growth", "--model", "22b", "--values", "1000,1001", "--csv", str(tmp_path / "g.csv"))
    assert_one_line_error(result, "seq_len = 1001", "must divide seq_len (1001)")


# -- which configurations fit ---------------------------------------------------------------

def test_fit_map_has_a_cell_for_each_t_and_p_and_the_plans_choice(tmp_path, actmem):
    """530B on 2,240 = 2^6·5·7 GPUs: t | gcd(128, 20480) up to a node (1, 2, 4, 8) and p
    dividing 2240/t and splitting the 105 layers: evenly, p | gcd(105, 2240) = 35 (1, 5, 7,
    35), or as Llama 3 does (⌈105/p⌉ = k on each stage between, r = 105 - (p-2)k >= 2 on the
    first and last): 4 (25 + 27 x 2 + 26), 8 (10 + 14 x 6 + 11), 10 (8 + 11 x 8 + 9),
    14 (4 + 8 x 12 + 5), 16 (3 + 7 x 14 + 4; 16 does not divide 2240/8 = 280). Not 2 (105
    is odd), 20 (r = 105 - 18 x 6 < 0), 28 (r = 105 - 26 x 4 = 1). The choice is the first row
    of `actmem plan --format csv`: t = 8, p = 35, as the paper trained it (Table 3)."""
    frame = frame_written(tmp_path, "fit", *PLAN_530B)
    sizes = {t: (1, 4, 5, 7, 8, 10, 14, 35) + ((16,) if t < 8 else ()) for t in (1, 2, 4, 8)}
    assert sorted(zip(frame.t, frame.p)) == sorted((t, p) for t in sizes for p in sizes[t])
    planned = actmem("plan", *PLAN_530B, "--format", "csv", "--top", "1")
    assert planned.exit_code == 0, planned.output
    first = pd.read_csv(io.StringIO(planned.stdout))
    best = frame[frame.is_best].reset_index(drop=True)
    pd.testing.assert_frame_equal(best[list(first.columns)], first)
    assert (best.t[0], best.p[0]) == (8, 35)
    assert list(frame.fits) == list(frame.fitting > 0)       # a cell shows a fitting one if any


def test_fit_map_frame_is_the_csv(tmp_path):
    from actmem.model.hardware import gpu_named
    from actmem.planner.plan import PlanRequest, plan
    from actmem.views.plot_frames import map_frame
    from actmem.sources.presets import load_preset
    from actmem.model.spec import Model

    gpu = gpu_named("a100")
    request = PlanRequest(model=Model(**load_preset("530b").model), gpus=2240, global_batch=2240, gpu=gpu,
                          gpu_memory_bytes=gpu.memory_bytes)
    frame = map_frame(plan(request), "530b")
    pd.testing.assert_frame_equal(frame_written(tmp_path, "fit", *PLAN_530B), frame)


def test_fit_takes_the_plan_request_flags_and_not_what_plan_prints(tmp_path):
    result = run_plot("fit", *PLAN_530B, "--top", "3", "--csv", str(tmp_path / "f.csv"))
    assert_one_line_error(result, "--top")


# Llama 3.1 8B (s = 8192, the flash core) on 64 GPUs: the planner sweeps c = 1 to 64 (2c | s).
PLAN_8B_CP = ("--model", "llama-3.1-8b", "--gpus", "64", "--global-batch", "512")


def test_fit_with_context_parallelism_draws_in_each_t_p_cell_its_best_c(tmp_path):
    """One cell a (t, p), not a panel a c: each cell is the fastest fitting (t, c, p) row
    over every c (else the leanest), and counts every c; --csv keeps every (t, c, p)."""
    frame = frame_written(tmp_path, "fit", *PLAN_8B_CP)
    assert sorted(frame.c.unique()) == [1, 2, 4, 8, 16, 32, 64]
    assert not frame.duplicated(["t", "c", "p"]).any()
    drawn = frame[frame.drawn].set_index(["t", "p"])
    assert drawn.index.is_unique and set(drawn.index) == set(zip(frame.t, frame.p))
    assert frame[frame.is_best].drawn.all()
    for (t, p), rows in frame.groupby(["t", "p"]):
        cell = drawn.loc[(t, p)]
        fitting = rows[rows.fits]
        if len(fitting):
            assert cell.iteration_s == fitting.iteration_s.min()
        else:
            assert cell.peak_bytes == rows.peak_bytes.min()
        assert (cell.cell_configurations, cell.cell_fitting) == (rows.configurations.sum(), rows.fitting.sum())
    assert drawn.c.nunique() > 1                        # the best c differs from cell to cell


def _cells_of(fig):
    """The map's axes and, for each cell's text, the (t, p) it stands in and its box and
    its cell's, in pixels, after the layout."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw_without_rendering()
    ax = fig.axes[0]
    ts = [int(label.get_text()) for label in ax.get_yticklabels()]
    ps = [int(label.get_text().split()[0]) for label in ax.get_xticklabels()]
    cells = []
    for text in ax.texts:
        x, y = text.get_position()
        corners = ax.transData.transform([(x - 0.5, y - 0.5), (x + 0.5, y + 0.5)])
        cells.append(((ts[round(y)], ps[round(x)]), text, text.get_window_extent(renderer), corners))
    return ax, cells


def _inside(box, corners) -> bool:
    (left, bottom), (right, top) = corners.min(axis=0), corners.max(axis=0)
    return left <= box.x0 and box.x1 <= right and bottom <= box.y0 and box.y1 <= top


@pytest.mark.parametrize("args, several_c", [(PLAN_8B_CP, True), (PLAN_530B, False)])
def test_fit_is_one_map_whose_cells_name_their_c_and_never_overprint(tmp_path, args, several_c):
    """One map and its colour bar whatever the plan swept; each cell's text inside its own
    cell at a readable size (5 pt or more at 8 x 5 in), the pipeline ticks apart; c written
    in each cell where the plan swept more than one."""
    pytest.importorskip("matplotlib")
    from actmem.views.plot import map_figure

    frame = frame_written(tmp_path, "fit", *args)
    ax, cells = _cells_of(map_figure(frame))
    assert len(ax.figure.axes) == 2
    drawn = frame[frame.drawn].set_index(["t", "p"])
    assert sorted(where for where, *_ in cells) == sorted(drawn.index)
    for where, text, box, corners in cells:
        assert _inside(box, corners), (where, text.get_text())
        assert text.get_fontsize() >= 5
        sizes = text.get_text().splitlines()[1]
        assert sizes.startswith(f"c={drawn.loc[where].c:,} ") if several_c else "c=" not in sizes
    ticks = [label.get_window_extent() for label in ax.get_xticklabels()]
    assert all(left.x1 < right.x0 for left, right in zip(ticks, ticks[1:]))


def test_fit_on_a_small_figure_shrinks_its_cells_text_and_keeps_c(tmp_path):
    """4 x 3 in leaves no room for four lines at 5 pt: a cell keeps its memory and its
    sizes (c first), still inside the cell."""
    pytest.importorskip("matplotlib")
    from actmem.views.plot import map_figure

    frame = frame_written(tmp_path, "fit", *PLAN_8B_CP)
    _, cells = _cells_of(map_figure(frame, size_in=(4, 3)))
    for where, text, box, corners in cells:
        assert _inside(box, corners), (where, text.get_text())
        memory, sizes = text.get_text().splitlines()
        assert memory.endswith(" GiB") and sizes.startswith("c=")


# -- formula against measurement --------------------------------------------------------------

# Two measured runs as `actmem validate --format csv` writes them. The 22B run (t=8, s=2048,
# b=4, L=48, SP + selective): 2sbh/t·L = 603,979,776 for a boundary input, 4sbh/t·L for Q and K.
_VALIDATION_CSV = """config,technique,rank,term,kind,formula_bytes,measured_bytes,error_percent,gate
22b t=8 p=1 m=1 b=4 n=1 tp-sp-sel,tp-sp-sel,0,qkv_input,paper,603979776,603979776,0.0,pass
22b t=8 p=1 m=1 b=4 n=1 tp-sp-sel,tp-sp-sel,0,query_key,paper,1207959552,1207959552,0.0,pass
22b t=8 p=1 m=1 b=4 n=1 tp-sp-sel,tp-sp-sel,0,attention_norm_statistics,residual,393216,393216,0.0,pass
22b t=8 p=1 m=1 b=4 n=1 tp-sp-sel,tp-sp-sel,0,total,total,1812725760,1812725760,0.0,pass
22b t=8 p=1 m=1 b=4 n=1 tp-sp-sel,tp-sp-sel,0,peak,floor,21881454592,22279798792,1.82,pass
22b t=8 p=1 m=1 b=4 n=1 tp-sp-sel,tp-sp-sel,0,native_dropout_mask_extra (4 B/element),pytorch_choice,0,1830813696,,info
small t=2 tp,tp,1,qkv_input,paper,4096,4096,0.0,pass
small t=2 tp,tp,1,token_ids,residual,0,9216,,fail
"""


@pytest.fixture
def validation_csv(tmp_path):
    path = tmp_path / "validation.csv"
    path.write_text(_VALIDATION_CSV)
    return str(path)


def test_validation_frame_is_the_rows_of_one_run(tmp_path, validation_csv):
    table = pd.read_csv(validation_csv)
    frame = frame_written(tmp_path, "validation", "--from", validation_csv)
    pd.testing.assert_frame_equal(frame, table.iloc[:6].reset_index(drop=True))
    other = frame_written(tmp_path, "validation", "--from", validation_csv, "--config", "small t=2 tp",
                          "--rank", "1")
    pd.testing.assert_frame_equal(other, table.iloc[6:].reset_index(drop=True))


def test_validation_columns_are_what_validate_writes():
    compare = pytest.importorskip("actmem_validate.compare")
    config = SimpleNamespace(label="22b", technique=SimpleNamespace(name="tp"))
    row = compare._row(config, 0, "qkv_input", 1, 1, "paper")
    assert (*row, "gate") == VALIDATION_COLUMNS


def test_validation_of_a_file_it_cannot_use_is_one_line(tmp_path, validation_csv):
    wrong = tmp_path / "wrong.csv"
    wrong.write_text("section,setting,value\nsettings,model,530b\n")
    out = str(tmp_path / "v.csv")
    assert_one_line_error(run_plot("validation", "--from", str(wrong), "--csv", out),
                          "lacks config, technique, rank")
    assert_one_line_error(run_plot("validation", "--from", validation_csv, "--config", "nope", "--csv", out),
                          "no rows for config 'nope' at rank 0")


# -- the files ---------------------------------------------------------------------------------

def png_size(path) -> tuple[int, int]:
    """Width and height from the IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


_PLOTS = {
    "memory": ("memory", "--model", "530b"),
    "growth": ("growth", "--model", "22b", "--recompute", "none", "--values", "512,1024,2048,4096"),
    "fit": ("fit", *PLAN_530B),
    "validation": ("validation",),     # --from added by the test
}


def _plot_args(kind, validation_csv):
    return _PLOTS[kind] + (("--from", validation_csv) if kind == "validation" else ())


@pytest.mark.parametrize("kind", list(_PLOTS))
def test_each_plot_is_a_png_of_figsize_times_dpi(tmp_path, kind, validation_csv):
    pytest.importorskip("matplotlib")
    path = tmp_path / f"{kind}.png"
    result = run_plot(*_plot_args(kind, validation_csv), "-o", str(path))
    assert result.exit_code == 0, result.output
    assert result.stdout == f"actmem plot: wrote {path} (800 x 500 px)\n"
    assert png_size(path) == (800, 500)                         # 8 x 5 in at 100 dpi


def test_size_and_dpi_set_the_pixels(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "small.png"
    result = run_plot("memory", "--model", "22b", "-o", str(path), "--size", "4x3", "--dpi", "50")
    assert result.exit_code == 0, result.output
    assert png_size(path) == (200, 150)


@pytest.mark.parametrize("kind", list(_PLOTS))
def test_each_plot_is_an_svg_of_figsize_in_points(tmp_path, kind, validation_csv):
    pytest.importorskip("matplotlib")
    path = tmp_path / f"{kind}.svg"
    result = run_plot(*_plot_args(kind, validation_csv), "-o", str(path), "--size", "6x4")
    assert result.exit_code == 0, result.output
    root = ElementTree.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert (root.get("width"), root.get("height")) == ("432pt", "288pt")   # 72 points an inch


def test_picture_and_frame_together(tmp_path):
    pytest.importorskip("matplotlib")
    png, csv = tmp_path / "m.png", tmp_path / "m.csv"
    result = run_plot("memory", "--model", "22b", "-o", str(png), "--csv", str(csv))
    assert result.exit_code == 0, result.output
    assert result.stdout == f"actmem plot: wrote {png} (800 x 500 px) and {csv}\n"
    assert png_size(png) == (800, 500) and len(pd.read_csv(csv)) == 7


# -- refusals ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["memory.jpg", "memory", "memory.pdf"])
def test_a_suffix_other_than_png_or_svg_is_one_line(tmp_path, name):
    result = run_plot("memory", "--model", "22b", "-o", str(tmp_path / name))
    assert_one_line_error(result, "name a .png or .svg file")
    assert not (tmp_path / name).exists()


def test_nothing_to_write_is_one_line():
    assert_one_line_error(run_plot("memory", "--model", "22b"), "give -o FILE.png")


def test_a_folder_that_is_not_there_is_one_line(tmp_path):
    result = run_plot("memory", "--model", "22b", "--csv", str(tmp_path / "missing" / "m.csv"))
    assert_one_line_error(result, "missing", "does not exist")


def test_without_matplotlib_a_picture_is_one_line_and_the_frame_still_writes(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)        # import matplotlib now fails
    result = run_plot("memory", "--model", "22b", "-o", str(tmp_path / "m.png"))
    assert_one_line_error(result, "needs matplotlib", "pip install 'actmem[plot]'")
    assert len(frame_written(tmp_path, "memory", "--model", "22b")) == 7


def test_plot_help_stays_off_the_heavy_imports():
    code = ("import sys\nfrom actmem.cli.plot_cli import plot\n"
            "for args in (['--help'], ['fit', '--help']):\n"
            "    try:\n        plot(args)\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in ('sympy', 'pandas', 'rich', 'matplotlib') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("args, fragment", [
    (("memory", "--model", "530b", "--csv", "{tmp}/m.csv", "--dpi", "50"), "--dpi sizes the picture"),
    (("memory", "--model", "530b", "--csv", "{tmp}/m.csv", "--size", "6x4"), "--size sizes the picture"),
    (("memory", "--model", "530b", "-o", "{tmp}/m.svg", "--dpi", "50"), "an SVG has none"),
    (("growth", "--model", "22b", "--over", "micro-batch", "--micro-batch", "2", "--csv", "{tmp}/g.csv"),
     "--micro-batch is what the plot sweeps"),
    (("growth", "--model", "22b", "--seq-len", "4096", "--csv", "{tmp}/g.csv"), "--seq-len is what the plot sweeps"),
])
def test_a_flag_the_plot_would_ignore_is_refused(tmp_path, args, fragment):
    """No setting is silently dropped: a picture size without a picture, PNG pixels for an
    SVG, or a fixed value of the very thing the sweep varies."""
    result = run_plot(*(arg.format(tmp=tmp_path) for arg in args))
    assert_one_line_error(result, fragment)


def test_a_file_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "taken.csv").mkdir()                    # a folder where the file would go
    result = run_plot("memory", "--model", "530b", "--csv", str(tmp_path / "taken.csv"))
    assert_one_line_error(result, "cannot write")


def test_growth_marks_the_first_point_over_the_gpu_in_its_frame(tmp_path):
    """The X of each line is a frame column: the first sweep point over the GPU right after
    one that fit. 530B at its own s = 2048 fits with tp-sp-sel (59.50 GiB, the README's
    example) and not without recompute at t = 8 (tp: 152.48 GiB), so tp-sp-sel stops fitting
    above 2048 and tp below it."""
    frame = frame_written(tmp_path, "growth", "--model", "530b")
    for name, rows in frame.groupby("technique", sort=False):
        fits = rows.fits.to_list()
        stops = [i for i in range(1, len(fits)) if fits[i - 1] and not fits[i]]
        assert rows.first_over_gpu.to_list() == [i == stops[0] if stops else False for i in range(len(fits))]
    stop = lambda name: frame[(frame.technique == name) & frame.first_over_gpu].seq_len.item()
    assert stop("tp-sp-sel") > 2048 >= stop("tp")
