"""Bash launch scripts read as bash expands them (actmem.sources.launch_script), never run.

Each expected word list is what bash itself makes of the script: checked by hand against
bash's rules (an unquoted ${A[@]} splits each element at whitespace, a quoted one keeps
each element whole, ${X:-d} takes d when X is unset or empty) and, in
test_the_reading_is_bashs_own, against bash where the machine has it."""

import re
import shutil
import subprocess

import pytest

from actmem.errors import SpecError
from actmem.sources.launch_script import looks_like_script, read

SCRIPT = r"""#!/bin/bash
export CUDA_DEVICE_MAX_CONNECTIONS=1
GPUS_PER_NODE=8
NUM_NODES=${NUM_NODES:-2}
WORLD_SIZE=$(($GPUS_PER_NODE*$NUM_NODES))
CHECKPOINT_PATH=$1 # a placeholder
DTYPE="bf16"
MODEL=(
    --num-layers 4   # a comment inside an array
    --hidden-size 256
    "--num-attention-heads 8"
)
MODEL+=(--seq-length 512)
if [[ "$DTYPE" == "fp8" ]]; then
    MODEL+=(--fp8-format hybrid)
elif [ -n "${WANDB_API_KEY}" ]; then
    MODEL+=(--wandb-project x)
else
    MODEL+=("--bf16")
fi
mkdir -p "$(dirname "$CHECKPOINT_PATH")" || { echo no; exit 1; }
torchrun --nproc_per_node $GPUS_PER_NODE --nnodes $NUM_NODES pretrain_gpt.py \
    ${MODEL[@]} \
    --save $CHECKPOINT_PATH --world "$WORLD_SIZE" --quoted "${MODEL[@]:0:0}"x
"""


def test_a_script_is_expanded_as_bash_would():
    launch = read(SCRIPT.replace(' --quoted "${MODEL[@]:0:0}"x', ""))
    assert launch.launcher == ["torchrun", "--nproc_per_node", "8", "--nnodes", "2"]
    assert launch.script == "pretrain_gpt.py"
    # the quoted array element splits when ${MODEL[@]} is expanded unquoted; the comment is no word;
    # the else branch ran (DTYPE is bf16, WANDB_API_KEY unset); $1 stays a placeholder; 8*2 = 16
    assert launch.arguments == ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
                                "--seq-length", "512", "--bf16", "--save", "$1", "--world", "16"]
    assert launch.environment == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert "WANDB_API_KEY" in launch.unset and "NUM_NODES" in launch.unset
    assert launch.positional == ("$1",)


def test_the_scripts_own_arguments_are_read_as_a_run_given_none_and_said():
    """case "$1" takes its branch for no arguments (bash run with none), ${3:-MOCK} its default; the Launch lists
    the arguments read, for the note (megatron_args.read) that says so."""
    launch = read('case "$1" in\n  big) L=80 ;;\n  *) L=32 ;;\nesac\nT=${3:-MOCK}\n'
                  "torchrun pretrain_gpt.py --num-layers $L --tokenizer-model $T\n")
    assert launch.arguments == ["--num-layers", "32", "--tokenizer-model", "MOCK"]
    assert launch.positional == ("$1", "$3")


def test_quoted_array_expansion_keeps_each_element_whole():
    launch = read('A=("--x 1" --y)\nB=("${A[@]}" --z)\npython train.py "${B[@]}"\n')
    assert launch.launcher == ["python"] and launch.script == "train.py"
    assert launch.arguments == ["--x 1", "--y", "--z"]


@pytest.mark.parametrize("text, arguments", [
    ('X=\npython t.py --a ${X:-d} --b ${X-e}\n', ["--a", "d", "--b"]),          # set but empty: :- only
    ('python t.py --a ${UNSET:+yes} --b ${#UNSET}\n', ["--a", "--b", "0"]),
    ("python t.py --a 'single $X' --b $'t\\tab'\n", ["--a", "single $X", "--b", "t\tab"]),
    ('N=6\npython t.py --n $((N / 4 + N % 4 * 10))\n', ["--n", "21"]),       # 1 + 2*10
    ('python t.py --n $(($1 * 2))\n', ["--n", "$(($1*2))"]),                 # a placeholder, one word
    ('V=(a b c)\npython t.py --v ${V[1]} --n ${#V[@]}\n', ["--v", "b", "--n", "3"]),
    # a command substitution either way is one placeholder word, named by its command
    ('python t.py --a `date +%s` --b $(nproc --all)\n', ["--a", "$(date…)", "--b", "$(nproc…)"]),
    # an unset variable before text that would go on with its name keeps its braces: ${1}0 is not $10, ${A}_x not
    # $A_x; where nothing could go on with it, as the script wrote it
    ('python t.py --a ${1}0 --b "${A}_x" --c $A/x --d "$1"\n', ["--a", "${1}0", "--b", "${A}_x", "--c", "$A/x",
                                                                   "--d", "$1"]),
    # the last line continued into the end of the file, as T5's example ends: bash ends the command there
    ('python t.py --a 1 \\\n    --b 2 \\\n', ["--a", "1", "--b", "2"]),
])
def test_expansions(text, arguments):
    assert read(text).arguments == arguments


@pytest.mark.parametrize("text, fragment", [
    ('if [ -f /etc/x ]; then A=(--bf16); fi\npython t.py ${A[@]}\n', "cannot know its answer"),
    ('for x in 1 2; do A+=(--x $x); done\npython t.py ${A[@]}\n', "a for statement sets variables"),
    ('echo hello\n', "runs no training script"),
    ('python a.py --x\npython b.py --y\n', "more than one training command (lines 1, 2)"),
    ('A[0]=--x\npython t.py ${A[@]}\n', "assigning one element of an array is not read"),
    ('python t.py --x "unterminated\n', "does not parse"),
])
def test_what_cannot_be_read_without_running_it_is_refused(text, fragment):
    with pytest.raises(SpecError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        read(text)


def test_an_if_it_cannot_decide_is_harmless_when_it_sets_nothing():
    text = 'if [ ! -f pretrain.py ]; then\n  echo "missing"\n  exit 1\nfi\npython pretrain.py --bf16\n'
    assert read(text).arguments == ["--bf16"]


def test_a_command_kept_in_a_string_for_bash_c_is_read_as_the_inner_shell_reads_it():
    text = ('ARGS=(--num-layers 2 --bf16)\nCMD="cd /x; python /m/pretrain_gpt.py ${ARGS[@]}"\n'
            'srun bash -c "${CMD}"\n')
    launch = read(text)
    assert launch.script == "/m/pretrain_gpt.py" and launch.arguments == ["--num-layers", "2", "--bf16"]


def test_a_bare_argument_list_is_not_a_script():
    assert not looks_like_script("# args\n--num-layers 2 \\\n  --bf16\n")
    assert looks_like_script("#!/bin/bash\nX=1\npython t.py\n")


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not on this machine")
def test_the_reading_is_bashs_own(tmp_path):
    """bash runs the script with `torchrun` a function that prints its words, one a line: the
    reading above must be the same words (mkdir does nothing; $1 is given as the literal
    text "$1", the placeholder actmem keeps)."""
    script = SCRIPT.replace(' --quoted "${MODEL[@]:0:0}"x', "")
    shim = 'torchrun() { printf "%s\\n" "$@"; }\nmkdir() { :; }\n'
    env = {"PATH": "/usr/bin:/bin"}
    printed = subprocess.run(["bash", "-c", shim + script.split("\n", 1)[1], "script", "$1"], capture_output=True, text=True,
                             env=env, cwd=tmp_path, check=True).stdout.splitlines()
    launch = read(script)
    assert printed == launch.launcher[1:] + [launch.script] + launch.arguments


CASES = r"""SCALE="8B" # or "800M"
case "${SCALE}" in
    "800M")
        LAYERS=4
        ;;
    8*|9*)
        LAYERS=8; EXTRA=(--hidden-size 64) ;;
    *)
        exit 1
        ;;
esac
case $NEVER_SET in
    x) ;;
    *) PRECISION=--bf16 ;;
esac
if [[ $BATCH -eq 0 ]]; then MODE=--interactive; else MODE=--batch; fi
torchrun pretrain_gpt.py --num-layers $LAYERS ${EXTRA[@]} $PRECISION $MODE
"""


def test_a_case_on_a_known_word_runs_its_first_matching_item_as_bash_does(tmp_path):
    """A quoted pattern matches literally, an unquoted one as a glob (8* matches 8B), * when nothing else does (an
    unset word is empty); [[ $X -eq 0 ]] evaluates an unset X as 0. Checked against bash where it is on the
    machine (Megatron's mamba example picks its shape with such a case)."""
    launch = read(CASES)
    assert launch.arguments == ["--num-layers", "8", "--hidden-size", "64", "--bf16", "--interactive"]
    if shutil.which("bash"):
        shim = 'torchrun() { printf "%s\\n" "$@"; }\n'
        printed = subprocess.run(["bash", "-c", shim + CASES], capture_output=True, text=True,
                                 env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path, check=True).stdout.splitlines()
        assert printed == [launch.script] + launch.arguments


@pytest.mark.parametrize("text, fragment", [
    ('case $(hostname) in\n  a) A=--x ;;\nesac\npython t.py $A\n',
     "a case statement on $(hostname), a value the script computes when it runs, sets variables"),
    ('X=a\ncase $X in\n  a) A=--x ;&\n  b) A=--y ;;\nesac\npython t.py $A\n',
     "a case statement whose items fall through to the next (;& or ;;&) sets variables"),
    ('if [ "$UNSET" -eq 0 ]; then A=--x; fi\npython t.py $A\n', "cannot know its answer"),
])
def test_a_case_or_test_it_cannot_decide_is_refused(text, fragment):
    """A case on a command's output, an item that falls through to the next (;&), and [ ]'s -eq on an empty word
    (an error in bash) are refused where they set the arguments."""
    with pytest.raises(SpecError, match=re.escape(fragment)):
        read(text)
