"""Megatron flags out of a launch script (``vshape plan --from-recipe FILE.sh``).

Recipes such as Megatron-LM's ``examples/llama/train_llama3_8b_h100_fp8.sh`` build the command
line from shell variables and arrays. This reads the subset of bash those scripts use, without
running anything:

* assignments ``NAME=value`` (also ``export``), arrays ``NAME=( ... )`` and ``NAME+=( ... )``;
* expansions ``$NAME``, ``${NAME}``, ``${NAME:-default}``, ``${NAME[@]}``, ``$((arithmetic))``;
  positional parameters (``$1``) and variables the script does not set are empty, so their
  defaults apply (the environment is not read: the plan depends on the file alone);
* ``if [[ ... ]]`` / ``[ ... ]`` with ``==``, ``!=``, ``-z``, ``-n``, ``!``, ``||``, ``&&``, ``else``,
  ``fi`` (file tests are false);
* the launch line: the words after the first ``*.py`` argument of the line that runs it.

Other commands (``mkdir``, ``echo``, ``exit``) are skipped. Anything the planner cannot read is a
one-line error naming the file and line.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from ..cli_parser import UsageError

_ASSIGN = re.compile(r"^(?:export\s+)?([A-Za-z_]\w*)(\+?)=(.*)$", re.S)
_BRACED = re.compile(r"\$\{([A-Za-z_]\w*|\d+)(\[@\]|\[\*\])?(?::-((?:[^{}]|\{[^{}]*\})*))?\}")
_PLAIN = re.compile(r"\$([A-Za-z_]\w*|\d)")
_ARITH = re.compile(r"\$\(\(([^()]*(?:\([^()]*\)[^()]*)*)\)\)")
_SAFE_ARITH = re.compile(r"^[\d\s+\-*/%()]+$")


class Recipe:
    def __init__(self, path: Path):
        self.path = path
        self.vars: dict[str, str] = {}
        self.arrays: dict[str, list[str]] = {}

    def error(self, line_no: int, message: str) -> UsageError:
        return UsageError(f"--from-recipe {self.path}:{line_no}: {message}")

    def expand(self, text: str, line_no: int) -> str:
        def braced(m: re.Match) -> str:
            name, index, default = m.group(1), m.group(2), m.group(3)
            if index:
                return " ".join(self.arrays.get(name, [self.vars[name]] if name in self.vars else []))
            value = self.vars.get(name, "")
            return value if value or default is None else self.expand(default, line_no)

        def arith(m: re.Match) -> str:
            expr = _PLAIN.sub(lambda v: self.vars.get(v.group(1), "0"), m.group(1))
            if not _SAFE_ARITH.match(expr):
                raise self.error(line_no, f"cannot evaluate $(({m.group(1)}))")
            return str(int(eval(expr.replace("/", "//"), {"__builtins__": {}})))  # digits and + - * / % only

        text = _ARITH.sub(arith, text)
        text = _BRACED.sub(braced, text)
        return _PLAIN.sub(lambda m: " ".join(self.arrays[m.group(1)][:1]) if m.group(1) in self.arrays
                          else self.vars.get(m.group(1), ""), text)

    def words(self, text: str, line_no: int) -> list[str]:
        try:
            return shlex.split(self.expand(text, line_no), comments=True)
        except ValueError as error:
            raise self.error(line_no, f"cannot split the words: {error}") from None

    def condition(self, text: str, line_no: int) -> bool:
        """``[[ a == b ]] || [ -z "$x" ] && ...``, evaluated left to right as bash does."""
        result, op = None, None
        for part in re.split(r"(\|\||&&)", text):
            part = part.strip()
            if part in ("||", "&&"):
                op = part
                continue
            value = self.test(self.words(part.strip("[] "), line_no))
            result = value if result is None else (result or value) if op == "||" else (result and value)
        return bool(result)

    @staticmethod
    def test(words: list[str]) -> bool:
        if words[:1] == ["!"]:
            return not Recipe.test(words[1:])
        if len(words) == 3 and words[1] in ("==", "=", "!="):
            return (words[0] == words[2]) == (words[1] != "!=")
        if len(words) == 2 and words[0] in ("-z", "-n"):
            return (words[1] == "") == (words[0] == "-z")
        if len(words) == 1:
            return words[0] != ""
        return False  # file tests and the rest: the plan must not depend on the machine it runs on

    def flags(self) -> list[str]:
        lines = self.path.read_text().replace("\\\n", " ").splitlines()
        active: list[bool] = []  # one entry per open if: whether its current branch runs
        taken: list[bool] = []
        launch: list[str] | None = None
        i = 0
        while i < len(lines):
            line_no, line = i + 1, lines[i].strip()
            i += 1
            running = all(active)
            if not line or line.startswith("#"):
                continue
            head = line.split()[0]
            if head == "if" or head == "elif":
                cond = line[len(head):].split("; then")[0].split(";then")[0]
                value = running and self.condition(cond, line_no) if head == "if" else \
                    (not taken[-1]) and self.condition(cond, line_no)
                if head == "if":
                    active.append(value)
                    taken.append(value)
                else:
                    active[-1], taken[-1] = value, taken[-1] or value
                continue
            if head == "else":
                active[-1] = not taken[-1]
                continue
            if head == "fi":
                active.pop()
                taken.pop()
                continue
            match = _ASSIGN.match(line)
            if match and match.group(3).startswith("("):
                body = match.group(3)[1:]
                while ")" not in _strip_comment(body) and i < len(lines):
                    body += "\n" + lines[i]
                    i += 1
                body = _strip_comment(body).rsplit(")", 1)[0] if ")" in _strip_comment(body) else body
                if running:
                    elements = [w for raw in body.splitlines() for w in self.words(raw, line_no)]
                    name = match.group(1)
                    self.arrays[name] = (self.arrays.get(name, []) if match.group(2) else []) + elements
                continue
            if not running:
                continue
            if match:
                value = self.words(match.group(3), line_no)
                self.vars[match.group(1)] = (self.vars.get(match.group(1), "") if match.group(2) else "") + \
                    " ".join(value)
                continue
            words = self.words(line, line_no)
            scripts = [k for k, w in enumerate(words) if w.endswith(".py")]
            if scripts and head not in ("echo", "if", "[", "[["):
                launch = words[scripts[0] + 1:]
        if launch is None:
            raise UsageError(f"--from-recipe {self.path}: no line runs a *.py training script (torchrun/python ...)")
        return launch


def _strip_comment(text: str) -> str:
    """Text without bash comments (a '#' that starts a word, outside quotes), per line."""
    out = []
    for raw in text.splitlines():
        quote, kept = None, []
        for k, ch in enumerate(raw):
            if quote:
                quote = None if ch == quote else quote
            elif ch in "'\"":
                quote = ch
            elif ch == "#" and (k == 0 or raw[k - 1].isspace()):
                break
            kept.append(ch)
        out.append("".join(kept))
    return "\n".join(out)


def recipe_flags(path: str | Path) -> list[str]:
    """The Megatron flags the launch script passes to its training script."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--from-recipe {path}: no such file")
    return Recipe(path).flags()
