"""The table of Megatron-LM's arguments (actmem/data, generated from the pinned parser by
tools/megatron_arguments.py) and actmem's classification of each: every option has exactly one
class, and the check fails when they drift apart."""

import copy

import click
import pytest

from actmem.sources import megatron_args, megatron_table
from actmem.cli.flags import _paste_command, megatron_spellings

MODELLED = sorted(set(megatron_spellings()) | set(megatron_args.SETTINGS))


def test_every_option_of_the_pinned_parser_has_one_class():
    assert megatron_table.problems(modelled=MODELLED) == []
    assert len(megatron_table.arguments()) > 800         # the whole parser, not a list written by hand


def test_the_table_is_the_pinned_commits():
    assert megatron_table.pinned_commit() == "d98e8a64ddf34856e74b24714e3bedb2f5a39553"


@pytest.mark.parametrize("inject, fragment", [
    (lambda table, classes: classes["groups"].pop("logging"), "group 'logging' has no class"),
    (lambda table, classes: classes["arguments"].update({"--no-such-thing": {"class": "ignored", "why": "x"}}),
     "--no-such-thing is classified but not an argument"),
    (lambda table, classes: table.pop("--num-layers"), "--num-layers is read by actmem but not an argument"),
    (lambda table, classes: classes["arguments"].update({"--num-layers": {"class": "ignored", "why": "x"}}),
     "--num-layers is read by actmem and classified as well"),
    (lambda table, classes: classes["arguments"]["--lr"].update({"class": "harmless"}) if "--lr" in
     classes["arguments"] else classes["arguments"].update({"--lr": {"class": "harmless", "why": "x"}}),
     "arguments --lr: class 'harmless'"),
    (lambda table, classes: classes["prefixes"].update({"--zzz-": {"class": "ignored", "why": "x"}}),
     "prefix --zzz- matches no argument"),
])
def test_the_check_fails_when_the_table_and_the_parser_disagree(inject, fragment):
    table = dict(megatron_table.arguments())
    classes = copy.deepcopy(megatron_table._classes())
    inject(table, classes)
    assert any(fragment in problem for problem in megatron_table.problems(table, classes, MODELLED))


def test_the_arguments_actmem_reads_take_as_many_values_as_megatrons_parser_gives_them():
    """A switch in actmem's options is a switch (no value) in Megatron's parser, and the reverse."""
    command = _paste_command()
    for param in command.params:
        if isinstance(param, click.Option):
            for name in param.opts + param.secondary_opts:
                if name in megatron_spellings():
                    expected = "0" if param.is_flag else "1"
                    assert megatron_table.arguments()[name].values == expected, name


@pytest.mark.parametrize("option, kind, why", [
    ("--lr", "ignored", "the learning-rate schedule"),
    ("--log-params-norm", "ignored", "logging"),
    ("--moe-router-topk", "not_modelled", "mixture of experts"),
    ("--fp8-param-gather", "not_modelled", "FP8 training"),
    ("--inference-max-requests", "ignored", "inference only: no training step reads it"),
    ("--use-torch-fsdp2", "not_modelled", "sharded data parallelism"),
])
def test_an_argument_is_classed_by_its_name_then_its_prefix_then_its_group(option, kind, why):
    assert megatron_table.classify(option) == (kind, why)


def test_an_argument_accepted_at_its_default_only_is_refused_at_another_value():
    assert megatron_table.classify("--optimizer", ["adam"])[0] == "ignored"
    kind, why = megatron_table.classify("--optimizer", ["sgd"])
    assert kind == "not_modelled" and "--optimizer sgd is not modelled (only adam)" in why


def test_a_name_megatron_does_not_have_gets_the_nearest_one():
    assert megatron_table.closest("--tensor-model-paralel-size") == "--tensor-model-parallel-size"
    assert megatron_table.closest("--frobnicate") is None


def test_a_paste_with_every_ignored_argument_changes_nothing(actmem):
    """Every option the table calls ignored, each with as many values as the parser takes (the
    value itself is never read), pasted beside a model and a run: the estimate is the same,
    and every one of them is listed as ignored."""
    base = ("--num-layers 2 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --vocab-size 32000 "
            "--micro-batch-size 1 --bf16 --attention-backend local --no-create-attention-mask-in-dataloader")
    ignored = [option for option in megatron_table.arguments()
               if option not in MODELLED and megatron_table.classify(option, ["adam"])[0] == "ignored"]
    assert len(ignored) > 250
    words = []
    for option in ignored:
        count = megatron_table.value_count(option)
        words += [option] + (["adam"] if option == "--optimizer" else
                             ["1"] * (1 if count in ("many", 1) else count if isinstance(count, int) else 0))
    plain = actmem.json("estimate", "--megatron-args", base)
    noisy = actmem.json("estimate", "--megatron-args", base + " " + " ".join(words))
    assert noisy["techniques"] == plain["techniques"] and noisy["verdict_bytes"] == plain["verdict_bytes"]
    listed = noisy["assumptions"][-1]
    assert listed.startswith("Megatron arguments ignored") and all(option in listed for option in ignored)


def test_the_spellings_a_paste_reads_come_from_the_one_flag_table():
    """Megatron's spelling of each flag is read from a paste; actmem's own spellings are not
    Megatron's and are refused there as unknown; --recompute-modules' words are a setting."""
    spellings = megatron_spellings()
    for name in ("--tensor-model-parallel-size", "--num-attention-heads", "--use-distributed-optimizer",
                 "--squared-relu", "--exp-avg-dtype", "--recompute-granularity", "--no-rope-fusion"):
        assert name in spellings, name
    assert not {"--tp", "--sp", "--hidden", "--attention-core", "--grad-dtype"} & set(spellings)
    assert "--recompute-modules" not in spellings and spellings["--num-layers"] and not spellings["--swiglu"]
