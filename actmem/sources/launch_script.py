"""A bash launch script read as the shell would expand it, without running anything.

Megatron-LM's own examples (``examples/gpt3/train_gpt3_175b_distributed.sh``) set variables,
build bash arrays, append to them under ``if``, and end in ``torchrun ${DISTRIBUTED_ARGS[@]}
pretrain_gpt.py ${GPT_MODEL_ARGS[@]} ...``. tree-sitter's bash grammar parses the script; this
module walks the tree and expands what bash would expand: assignments (``=``, ``+=``, arrays,
``export``, ``unset``), ``$X``, ``${X:-default}``, ``${A[@]}`` (split where unquoted, as
bash splits), ``$((arithmetic))`` and ``if`` on string tests. No command is ever run:

- ``$(command)`` and a script's positional parameters (``$1``) are placeholders that keep
  the argument's shape (``--save $1`` stays two words), as are variables the script never
  sets; a test on them (``[ -n "$WANDB_API_KEY" ]``) reads them as unset, as a clean
  environment would, and the reading says so.
- A condition it cannot decide (``[ -f FILE ]``, a command) is refused where its branches
  set a variable or launch the training, since either answer could change the arguments.

The training command is the first word ending in ``.py`` of a command (or, for a script that
hands the command to ``srun bash -c "$CMD"``, of a variable's value, read as the inner shell
reads it); the words after it are the training script's arguments and the words before it its
launcher.
"""

import fnmatch
import re
import shlex
from dataclasses import dataclass, field

from actmem.errors import SpecError


class Unknown(str):
    """A value left to the script's runtime: ``$1``, ``$(cmd)``, a variable it never sets."""


@dataclass
class Launch:
    """What a launch script runs: ``launcher`` (torchrun and its options), ``script``
    (pretrain_gpt.py), ``arguments`` (the training script's), ``environment`` (the variables
    exported to it) and ``unset`` (variables the script reads where they are unset: set nowhere, later, or
    only in a branch not taken)."""

    launcher: list
    script: str
    arguments: list
    environment: dict = field(default_factory=dict)
    unset: tuple = ()
    positional: tuple = ()
    """The script's own arguments it reads ($1, ${2:-default}), each read as a run with none would read it."""


#: nodes whose children are statements, walked in order
_BLOCKS = {"program", "compound_statement", "subshell", "list", "pipeline", "redirected_statement",
           "do_group", "negated_command"}
#: nodes that may hide assignments or the training command behind a loop or a function
_OPAQUE_BLOCKS = {"for_statement", "c_style_for_statement", "while_statement", "case_statement",
                  "function_definition"}
#: how a case item may end besides ';;', going on to the next items: not read
_FALLTHROUGH = {";&", ";;&"}
_TRAINING = re.compile(r"\.py$")


def looks_like_script(text: str) -> bool:
    """A bare argument list starts with an argument; a script with anything else."""
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            return not line.startswith("-")
    return False


def read(text: str) -> Launch:
    """The training command a bash launch script runs (SpecError when there is none, or more
    than one, or when the script decides its arguments in a way it cannot read)."""
    import tree_sitter
    import tree_sitter_bash

    # a last line continued into the end of the file (T5's example ends so): bash ends the command there, where
    # tree-sitter's grammar finds an error
    stripped = text.rstrip()
    source = (stripped[:-1] + "\n" if stripped.endswith("\\") and not stripped.endswith("\\\\") else text).encode()
    tree = tree_sitter.Parser(tree_sitter.Language(tree_sitter_bash.language())).parse(source)
    if tree.root_node.has_error:
        line = _first_error(tree.root_node)
        raise SpecError(f"--megatron-args: not a bash script bash would run (line {line} does not parse)")
    shell = _Shell(source)
    shell.run(tree.root_node)
    return shell.launch()


def _first_error(node) -> int:
    if node.type == "ERROR" or node.is_missing:
        return node.start_point[0] + 1
    return next((_first_error(c) for c in node.children if c.has_error or c.is_missing), node.start_point[0] + 1)


class _Shell:
    """The variables of one reading of the script, and the commands it would run."""

    def __init__(self, source: bytes):
        self.source = source
        self.variables: dict = {}
        self.exported: set = set()
        self.commands: list = []          # (words, environment prefix, line)
        self.read_unset: dict = {}        # name -> first line read

    # statements ------------------------------------------------------------------------
    def run(self, node) -> None:
        kind = node.type
        if kind in _BLOCKS:
            for child in node.named_children:
                self.run(child)
        elif kind == "variable_assignment":
            self._assign(node)
        elif kind == "declaration_command":
            self._declare(node)
        elif kind == "unset_command":
            for child in node.named_children:
                self.variables.pop(self._text(child), None)
        elif kind == "command":
            self._command(node)
        elif kind == "if_statement":
            self._if(node)
        elif kind in _OPAQUE_BLOCKS:
            why = self._case(node) if kind == "case_statement" else ""       # None: the case ran, as bash runs it
            if why is not None and self._changes_arguments(node):
                raise SpecError(f"--megatron-args: line {node.start_point[0] + 1}: a {kind.replace('_', ' ')}{why} "
                                "sets variables or launches the training, and actmem reads a script without "
                                "running it; paste the training script's arguments instead")

    def _assign(self, node, environment: dict | None = None) -> None:
        name_node, value_node = node.child_by_field_name("name"), node.child_by_field_name("value")
        name = self._text(name_node)
        append = any(child.type == "+=" for child in node.children)
        if name_node.type == "subscript":
            raise SpecError(f"--megatron-args: line {node.start_point[0] + 1}: {self._text(node)}: "
                            "assigning one element of an array is not read; build the array whole")
        if value_node is None:
            value = ""
        elif value_node.type == "array":
            value = [word for child in value_node.named_children if child.type != "comment"
                     for word in self._words(child)]
        else:
            value = self._value(value_node)
        target = self.variables if environment is None else environment
        if append:
            old = target.get(name, [] if isinstance(value, list) else "")
            value = (old if isinstance(old, list) else [old]) + value if isinstance(value, list) \
                else _joined([_as_scalar(old), value])
        target[name] = value

    def _declare(self, node) -> None:
        export = self._text(node.children[0]) == "export"
        for child in node.named_children:
            if child.type == "variable_assignment":
                self._assign(child)
                name = self._text(child.child_by_field_name("name"))
            elif child.type == "variable_name":
                name = self._text(child)
            else:
                continue        # declare's options (-a, -x)
            if export:
                self.exported.add(name)

    def _command(self, node) -> None:
        environment = {}
        words = []
        for child in node.named_children:
            if child.type == "variable_assignment":
                self._assign(child, environment)
            elif child.type == "command_name":
                words += self._words(child.named_children[0])
            elif node.field_name_for_child(node.children.index(child)) == "argument":
                words += self._words(child)
        if words:
            self.commands.append((words, environment, node.start_point[0] + 1))

    def _if(self, node) -> None:
        condition, body, clauses, state = [], [], [], "condition"
        for index, child in enumerate(node.children):
            if child.type in ("elif_clause", "else_clause"):
                clauses += self._clauses(child)
            elif state == "condition" and node.field_name_for_child(index) == "condition":
                condition.append(child)
            elif child.type == "then":
                state = "body"
            elif state == "body" and child.is_named and child.type != "comment":
                body.append(child)
        branches = [(condition, body)] + clauses
        for condition, body in branches:
            verdict = True if condition is None else self._test_all(condition)
            if verdict is None:
                if any(self._changes_arguments(n) for _, b in branches for n in b):
                    raise SpecError(f"--megatron-args: line {node.start_point[0] + 1}: `{self._line(node)}` "
                                    "decides the arguments, and actmem cannot know its answer without "
                                    "running the script; paste the training script's arguments instead")
                return
            if verdict:
                for statement in body:
                    self.run(statement)
                return

    def _case(self, node) -> str | None:
        """Run the first item of a case statement whose pattern matches its word, as bash does (a quoted
        pattern literally, an unquoted one as a glob), and return None; where it cannot, why not, for the caller
        to judge it opaque: the word is a value the script computes when it runs, or an item falls through
        (';&', ';;&')."""
        value = node.child_by_field_name("value")
        word = self._condition_value(value)
        items = [child for child in node.named_children if child.type == "case_item"]
        if word is None:
            return f" on {self._text(value)}, a value the script computes when it runs,"
        if any(child.type in _FALLTHROUGH for item in items for child in item.children):
            return " whose items fall through to the next (;& or ;;&)"
        for item in items:
            patterns = [item.children[i] for i in range(item.child_count) if item.field_name_for_child(i) == "value"]
            if any(self._matches(word, pattern) for pattern in patterns):
                for statement in item.named_children:
                    if statement not in patterns and statement.type != "comment":
                        self.run(statement)
                return None
        return None

    def _matches(self, word: str, pattern) -> bool:
        if pattern.type in ("string", "raw_string"):
            return word == self._condition_value(pattern)
        return fnmatch.fnmatchcase(word, self._text(pattern))

    def _clauses(self, node) -> list:
        """[(condition nodes or None for else, body nodes)] of an elif or else clause (an elif
        clause holds the clauses after it in some grammars' trees, never here: flat)."""
        if node.type == "else_clause":
            return [(None, [c for c in node.named_children if c.type != "comment"])]
        condition, body, seen_then = [], [], False
        for child in node.children:
            if child.type == "then":
                seen_then = True
            elif child.is_named and child.type != "comment":
                (body if seen_then else condition).append(child)
        return [(condition, body)]

    def _changes_arguments(self, node) -> bool:
        if node.type in ("variable_assignment", "declaration_command", "unset_command"):
            return True
        if node.type == "command" and any(_TRAINING.search(self._text(c)) for c in node.named_children):
            return True
        return any(self._changes_arguments(child) for child in node.named_children)

    # conditions --------------------------------------------------------------------------
    def _test_all(self, nodes) -> bool | None:
        verdicts = [self._test(n) for n in nodes if n.type not in (";", "comment")]
        return verdicts[-1] if verdicts else None

    def _test(self, node) -> bool | None:
        kind = node.type
        if kind == "test_command":
            inner = node.named_children
            return self._expression(inner[0], self._text(node).startswith("[[")) if len(inner) == 1 else None
        if kind == "list":
            left, operator, right = node.children[0], self._text(node.children[1]), node.children[2]
            a, b = self._test(left), self._test(right)
            if operator == "&&":
                return False if False in (a, b) else (None if None in (a, b) else True)
            return True if True in (a, b) else (None if None in (a, b) else False)
        if kind == "negated_command":
            verdict = self._test(node.named_children[0])
            return None if verdict is None else not verdict
        return None                                   # a command: its exit status is unknowable here

    def _expression(self, node, arithmetic_words: bool = False) -> bool | None:
        """A test's verdict (None where it cannot be known). ``arithmetic_words``: inside [[ ]], whose -eq and
        the like evaluate their operands as arithmetic, an empty or unset one as 0; in [ ] an empty one is an
        error (bash: 'integer expression expected'), left undecided."""
        kind = node.type
        if kind == "parenthesized_expression":
            return self._expression(node.named_children[0], arithmetic_words)
        if kind == "unary_expression":
            operator = self._text(node.child_by_field_name("operator") or node.children[0])
            operand = node.named_children[-1]
            if operator == "!":
                verdict = self._expression(operand, arithmetic_words)
                return None if verdict is None else not verdict
            value = self._condition_value(operand)
            if value is None or operator not in ("-z", "-n"):
                return None
            return (value == "") == (operator == "-z")
        if kind == "binary_expression":
            operator = self._text(node.child_by_field_name("operator"))
            left = node.child_by_field_name("left")
            right = node.child_by_field_name("right")
            if operator in ("&&", "||"):
                a, b = self._expression(left, arithmetic_words), self._expression(right, arithmetic_words)
                if operator == "&&":
                    return False if False in (a, b) else (None if None in (a, b) else True)
                return True if True in (a, b) else (None if None in (a, b) else False)
            a, b = self._condition_value(left), self._condition_value(right)
            if a is None or b is None:
                return None
            if operator in ("==", "="):
                return a == b
            if operator == "!=":
                return a != b
            tests = {"-eq": int.__eq__, "-ne": int.__ne__, "-lt": int.__lt__, "-le": int.__le__,
                     "-gt": int.__gt__, "-ge": int.__ge__}
            if "" in (a, b) and not arithmetic_words:
                return None
            numbers = _integer(a or "0"), _integer(b or "0")
            if operator in tests and None not in numbers:
                return tests[operator](*numbers)
            return None
        value = self._condition_value(node)           # [ "$X" ]: a non-empty string
        return None if value is None else value != ""

    def _condition_value(self, node) -> str | None:
        """A test's operand, with the variables the script never sets read as unset (empty);
        None where it holds a command's output."""
        value = _as_scalar(self._value(node, unset_as_empty=True))
        return None if isinstance(value, Unknown) else value

    # words and values ----------------------------------------------------------------------
    def _words(self, node) -> list[str]:
        """The words one node becomes: quoted pieces stay whole, unquoted expansions split."""
        kind = node.type
        if kind in ("string", "raw_string", "ansi_c_string", "translated_string"):
            value = self._value(node)
            return value if isinstance(value, list) else [value]
        if kind in ("simple_expansion", "expansion", "command_substitution", "arithmetic_expansion"):
            value = self._value(node)
            items = value if isinstance(value, list) else [value]
            return [piece for item in items for piece in _split(item)]
        if kind == "concatenation":
            return _concatenated([self._words(child) for child in self._pieces(node)])
        return [self._literal(node)]

    def _value(self, node, unset_as_empty: bool = False):
        """A node's value as one string (or a list, for ``"${A[@]}"``), without splitting."""
        kind = node.type
        if kind == "raw_string":
            return self._text(node)[1:-1]
        if kind == "ansi_c_string":
            return self._text(node)[2:-1].encode().decode("unicode_escape")
        if kind in ("string", "translated_string"):
            pieces = [self._value(child, unset_as_empty) for child in self._pieces(node)]
            if len(pieces) == 1 and isinstance(pieces[0], list):
                return pieces[0]                    # "${A[@]}": each element a word
            return _joined([" ".join(p) if isinstance(p, list) else p for p in pieces])
        if kind == "simple_expansion":
            return self._variable(self._text(node)[1:], unset_as_empty)
        if kind == "expansion":
            return self._expansion(node, unset_as_empty)
        if kind == "command_substitution":        # never run: a placeholder of one word, as `cmd` or $(cmd)
            text = self._text(node)
            inner = text[1:-1] if text.startswith("`") else text[2:-1]
            return Unknown(f"$({(inner.split() or [''])[0]}…)")
        if kind == "arithmetic_expansion":
            number = self._arithmetic(node.named_children[0]) if node.named_children else None
            # a placeholder of one word, as bash's result would be
            return Unknown("".join(self._text(node).split())) if number is None else str(number)
        if kind == "concatenation":
            return _joined([_as_scalar(self._value(child, unset_as_empty)) for child in self._pieces(node)])
        return self._literal(node)

    def _pieces(self, node) -> list:
        """A string's or concatenation's parts, with the text between parts as literal pieces
        (the grammar leaves some of a string's spaces out of its children)."""
        start, end = node.start_byte, node.end_byte
        children = [c for c in node.children if c.type not in ('"', '$"')]
        if node.type in ("string", "translated_string"):
            start, end = start + (2 if node.type == "translated_string" else 1), end - 1
        pieces, at = [], start
        for child in children:
            if child.start_byte > at:
                pieces.append(_Literal(self.source[at:child.start_byte].decode()))
            pieces.append(child)
            at = child.end_byte
        if end > at:
            pieces.append(_Literal(self.source[at:end].decode()))
        return pieces

    def _literal(self, node) -> str:
        if isinstance(node, _Literal):
            return node.text
        if node.type == "string_content":
            return re.sub(r'\\([$`"\\\n])', r"\1", self._text(node))
        return re.sub(r"\\(.)", r"\1", self._text(node))       # an unquoted word: \x is x

    def _variable(self, name: str, unset_as_empty: bool):
        if name in self.variables:
            return self.variables[name]
        if name in ("@", "*"):
            return []                                 # the script is read with no arguments
        if name == "#":
            return "0"
        self.read_unset.setdefault(name, None)
        return "" if unset_as_empty else Unknown(f"${name}")

    def _expansion(self, node, unset_as_empty: bool):
        """${X}, ${X:-word}, ${X-word}, ${X:=word}, ${X:+word}, ${A[@]}, ${A[*]}, ${#X}."""
        children = [c for c in node.children if c.type not in ("${", "}")]
        if children and children[0].type == "#":
            value = self._expansion_target(children[1], unset_as_empty=True)     # unset: length 0
            return str(len(value)) if not isinstance(value, Unknown) else Unknown(self._text(node))
        target = self._expansion_target(children[0], unset_as_empty=False) if children else ""
        operator = self._text(children[1]) if len(children) > 1 else None
        word = _joined([_as_scalar(self._value(c, unset_as_empty)) for c in children[2:]]) if len(children) > 2 else ""
        is_set = not (isinstance(target, Unknown) and target.startswith("$"))
        if operator is None:
            return "" if unset_as_empty and not is_set else target
        empty = not is_set or target in ("", [])
        if operator in (":-", ":="):
            value = word if empty else target
        elif operator in ("-", "="):
            value = word if not is_set else target
        elif operator == ":+":
            value = "" if empty else word
        elif operator == "+":
            value = "" if not is_set else word
        else:
            return Unknown(self._text(node))          # substrings, patterns: not read
        if operator in (":=", "=") and empty:
            self.variables[self._text(children[0])] = value
        return value

    def _expansion_target(self, node, unset_as_empty: bool):
        if node.type == "subscript":
            name = self._text(node.child_by_field_name("name"))
            index = self._text(node.child_by_field_name("index"))
            value = self._variable(name, unset_as_empty)
            items = value if isinstance(value, list) else ([] if value == "" else [value])
            if index in ("@", "*"):
                return list(items) if index == "@" else " ".join(items)
            number = _integer(index)
            return items[number] if number is not None and number < len(items) else ""
        value = self._variable(self._text(node), unset_as_empty)
        return value[0] if isinstance(value, list) and value else ("" if isinstance(value, list) else value)

    def _arithmetic(self, node) -> int | None:
        kind = node.type
        if kind == "number":
            return _integer(self._text(node))
        if kind in ("simple_expansion", "expansion", "variable_name"):
            value = self._value(node) if kind != "variable_name" else self._variable(self._text(node), False)
            return _integer(_as_scalar(value)) if not isinstance(value, Unknown) else None
        if kind == "parenthesized_expression":
            return self._arithmetic(node.named_children[0])
        if kind == "binary_expression":
            a = self._arithmetic(node.child_by_field_name("left"))
            b = self._arithmetic(node.child_by_field_name("right"))
            operator = self._text(node.child_by_field_name("operator"))
            if a is None or b is None or (operator in ("/", "%") and b == 0):
                return None
            operations = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__,
                          "/": lambda x, y: int(x / y), "%": lambda x, y: x - y * int(x / y)}
            return operations[operator](a, b) if operator in operations else None
        return None

    # the launch --------------------------------------------------------------------------------
    def launch(self) -> Launch:
        found = [(words, env, line) for words, env, line in self.commands if _training_index(words) is not None]
        if not found:
            found = [(words, {}, None) for words in self._commands_in_strings()]
        if not found:
            raise SpecError("--megatron-args: the script runs no training script (no command with a "
                            "word ending in .py, such as torchrun ... pretrain_gpt.py ...)")
        if len(found) > 1:
            lines = ", ".join(str(line) for _, _, line in found if line) or "several strings"
            raise SpecError(f"--megatron-args: the script runs more than one training command (lines {lines}); "
                            "give one script a run")
        words, prefix, _ = found[0]
        at = _training_index(words)
        environment = {name: _as_scalar(self.variables[name]) for name in sorted(self.exported)
                       if name in self.variables}
        environment.update(prefix)
        return Launch(words[:at], words[at], words[at + 1:], environment,
                      tuple(name for name in self.read_unset if not name.isdigit()),
                      tuple(f"${name}" for name in sorted((n for n in self.read_unset if n.isdigit()), key=int)))

    def _commands_in_strings(self) -> list:
        """A command kept in a variable for ``bash -c "$CMD"`` (an sbatch script): its value read
        as the inner shell reads it."""
        commands = []
        for value in self.variables.values():
            if isinstance(value, str) and re.search(r"\S\.py(\s|$)", value):
                for line in re.split(r"[;\n]", value):
                    try:
                        words = shlex.split(line)
                    except ValueError:
                        continue
                    if _training_index(words) is not None:
                        commands.append(words)
        return commands

    def _text(self, node) -> str:
        return self.source[node.start_byte:node.end_byte].decode()

    def _line(self, node) -> str:
        return self._text(node).split("\n")[0].rstrip("; ")


@dataclass(frozen=True)
class _Literal:
    """Text between a string's parts."""

    text: str
    type: str = "literal"


def _training_index(words) -> int | None:
    return next((i for i, word in enumerate(words) if _TRAINING.search(word) and not word.startswith("-")), None)


def _split(value: str) -> list[str]:
    """Word splitting of an unquoted expansion (the default IFS); a placeholder stays one word."""
    return [Unknown(word) for word in value.split()] if isinstance(value, Unknown) else value.split()


def _joined(pieces) -> str:
    """The pieces as one string, a placeholder where any is one. An unset variable's placeholder ``$1`` or ``$A``
    before text that would go on with its name is written ``${1}``, ``${A}``, as the script wrote it: ``${1}0`` is
    not ``$10``."""
    pieces = [_braced(piece) if isinstance(piece, Unknown) and following[:1] and _NAME_CHAR.match(following) else piece
              for piece, following in zip(pieces, [*pieces[1:], ""])]
    text = "".join(pieces)
    return Unknown(text) if any(isinstance(p, Unknown) for p in pieces) else text


_NAME_CHAR = re.compile(r"[A-Za-z0-9_]")
_BARE_VARIABLE = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*|[0-9])$")


def _braced(placeholder: "Unknown") -> "Unknown":
    """``$NAME`` as ``${NAME}`` (another placeholder as it is)."""
    bare = _BARE_VARIABLE.match(placeholder)
    return Unknown(f"${{{bare.group(1)}}}") if bare else placeholder


def _concatenated(parts: list[list[str]]) -> list[str]:
    """a"$B"c: the last word of each part joins the first of the next."""
    words = [""]
    for part in parts:
        if not part:
            continue
        words[-1] = _joined([words[-1], part[0]])
        words += part[1:]
    return [w for w in words if w != ""] if len(words) > 1 or words[0] else []


def _as_scalar(value) -> str:
    return " ".join(value) if isinstance(value, list) else value


def _integer(text) -> int | None:
    try:
        return int(str(text), 0) if not isinstance(text, Unknown) else None
    except ValueError:
        return None
