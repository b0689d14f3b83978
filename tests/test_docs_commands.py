"""Every command in README.md's and docs/*.md's fenced code blocks runs as written from the clone's root after `make
setup` (issue 81; the docs write the .venv's executables out, `.venv/bin/python -m specbench...`, as README.md and
docs/running.md say once, test_one_convention_for_the_venv): each line is collected, split into its simple commands,
and each command checked without running it:

- `make TARGET VAR=...`: `make -n TARGET VAR=...` exits 0 from the repository root, and every command its recipe
  prints is checked as below (`for v in ...; do ... done` loops expanded; a loop over nothing is an error);
- `python -m specbench.X ...` for a Hydra app (HYDRA_APPS: its conf/ config name): Hydra's own command-line parser
  reads the flags (`-m`, `--config-name`, ...), and the config is composed in-process with the line's overrides
  against the typed schema (every key and group real, every value of the right type), then resolved; under `-m`
  the sweep is expanded as Hydra's basic sweeper does (the experiment's `hydra.sweeper.params`, then the line's,
  the line's winning), and every value of every swept key is composed at least once (job j takes each key's j-th
  value, cycling; not the whole product); `--help` runs the command and must exit 0;
- `python -m specbench.X ...` for an argparse app (ARGPARSE_APPS): `--help` exits 0, and the line's arguments are
  parsed by the app's own parser (flags, types, choices), stopping before the command runs, and every `--flag` the
  line uses is in the help text;
- `torchrun ... -m specbench.train ...`: torchrun's own parser reads its flags, then the module part as above;
- `sbatch ... SCRIPT ARGS`: `bash -n SCRIPT`, and ARGS checked as the overrides of the module the script runs
  (SBATCH_SCRIPTS); `bash SCRIPT` / `sh SCRIPT`: `bash -n`;
- `.venv/bin/hf SUBCOMMAND ...`: `hf SUBCOMMAND --help` exits 0 and lists every `--flag` the line uses;
- the command words in NOT_CHECKED are not checked, each for the reason given there; any other command is an error.

Rules of collection: blocks tagged bash / sh / shell / console are shell; an untagged block is shell when every line
of it starts with a command word this test knows (else it is output, e.g. a printed report); other tags are not
shell. `\\` continues a line; `#` starting a word outside quotes starts a comment; `;`, `&&`, `||` and `|` separate
commands; `NAME=value` words before a command set its environment (not checked) and `timeout`, `nice`, `env`,
`time` wrappers are stripped; `$NAME` is expanded with PWD = the repository root. A `<...>` placeholder is replaced
by its dummy in PLACEHOLDERS (an unlisted one fails: add it there); `...` and `$(...)` in a line fail (write a real
value: the line must run as written)."""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf, open_dict

from specbench.core.config import register_schema

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
VENV_BIN = Path(sys.executable).parent  # the .venv whose python runs the tests: its hf is the docs' .venv/bin/hf

# a `<...>` in a doc line stands for the reader's own value; checked with this dummy in its place
PLACEHOLDERS = {
    "<p>": "debug",                                             # a SLURM partition
    "<repo>": "https://example.invalid/specbench.git",          # (git clone: not checked)
    "<your CUDA, e.g. cu128>": "cu128",                         # (pip: not checked)
    "<the commit you copied>": "0123abcd",                      # SPECBENCH_COMMIT (an environment value)
}

# `python -m <module>` entry points composed by Hydra: the config (conf/<name>.yaml) each composes
# (specbench/core/cli.py `entry`, or `@hydra.main(config_name=...)` in the module's code)
HYDRA_APPS = {
    "specbench.run": "config", "specbench.train": "config", "specbench.export": "config",
    "specbench.download": "config", "specbench.vocab": "config", "specbench.limit": "limit",
    "specbench.peer": "peer", "specbench.perf": "perf", "specbench.perf_drafters": "perf_drafters",
    "specbench.trainmem": "trainmem",
}
# `python -m <module>` entry points with an argparse parser: the module whose main() builds it
ARGPARSE_APPS = {
    "specbench.report": "specbench.bench.report.main", "specbench.gpu_check": "specbench.tools.gpu_check",
    "specbench.cluster": "specbench.tools.cluster", "specbench.fetch_data": "specbench.data.fetch_data",
    "specbench.rehearse": "specbench.tools.rehearse",
}
PLAIN_APPS = {"specbench.trainable": "prints make train's drafter list; takes no arguments"}
# `python -m <module>` of other packages
OTHER_MODULES = {
    "pip": "installs from the package registry (not reachable from a test)",
    "venv": "creates a virtual environment (make setup's first step)",
    "pytest": "the test suite (make test, make test-fast): its options are pytest's",
}
# sbatch scripts: the module whose Hydra overrides the script's arguments are
SBATCH_SCRIPTS = {"scripts/slurm/train.sbatch": "specbench.train"}
# command words not checked, and why
NOT_CHECKED = {
    "git": "git clone needs the network and a URL of the reader's",
    "pip": "installs from the package registry (not reachable from a test)",
    ".venv/bin/pip": "installs from the package registry (not reachable from a test)",
    "cd": "a shell builtin (the clone's directory)",
}
# what a make recipe runs beside the commands above (make -n output only): file plumbing and shell builtins
RECIPE_PLUMBING = {"set", "test", "[", "continue", "touch", "rm", "cp", "mkdir", "exit", "true", "echo"}  # (and NAME=value)
WRAPPERS = {"timeout": 1, "nice": 0, "env": 0, "time": 0, "exec": 0}  # word -> positional arguments it takes
SHELL_TAGS = {"bash", "sh", "shell", "console"}
KNOWN_WORDS = {"make", "python", "python3", "torchrun", "sbatch", "bash", "sh", "hf", *NOT_CHECKED}


@dataclass(frozen=True)
class DocLine:
    path: str
    lineno: int
    text: str  # continuation lines joined, comments kept

    def __str__(self) -> str:
        return f"{self.path}:{self.lineno}"


# ---------------------------------------------------------------------------------------------------- collection

def strip_comment(line: str) -> str:
    """The line up to a `#` that starts a word outside quotes (as bash reads it)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def command_word(line: str) -> str:
    words = strip_comment(line).split()
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words.pop(0)
    return words[0] if words else ""


def known_word(word: str) -> bool:
    return word in KNOWN_WORDS or Path(word).name in {"python", "python3", "torchrun", "hf"}


def fenced_blocks(text: str):
    """(tag, [(lineno, line)]) of every fenced block (``` or ~~~, indented in a list item or not)."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, tag = m.groups()
        body, i = [], i + 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append((i + 1, lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip()))
            i += 1
        yield tag.lower(), body
        i += 1


def doc_lines() -> list[DocLine]:
    out = []
    for path in DOCS:
        for tag, body in fenced_blocks(path.read_text()):
            code = [(n, line) for n, line in body if strip_comment(line).strip()]
            if tag not in SHELL_TAGS and not (tag == "" and code and all(
                    known_word(command_word(line)) for _, line in code)):
                continue
            start, buf = None, ""
            for n, line in body:
                if not buf and not strip_comment(line).strip():
                    continue
                start = start or n
                if line.rstrip().endswith("\\"):
                    buf += line.rstrip()[:-1] + " "
                    continue
                out.append(DocLine(str(path.relative_to(REPO)), start, (buf + line).strip()))
                start, buf = None, ""
    return out


# ---------------------------------------------------------------------------------------------------- shell reading

def expand_loops(text: str) -> str:
    """`for v in a b; do BODY; done` -> BODY with $v = a; BODY with $v = b (innermost loops first)."""
    loop = re.compile(r"for\s+(\w+)\s+in\s+([^;]*?)\s*;\s*do\s+((?:(?!\bfor\s).)*?)\s*;?\s*\bdone\b", re.S)
    while m := loop.search(text):
        var, values, body = m.group(1), m.group(2).split(), m.group(3)
        if not values:
            raise AssertionError(f"a loop over nothing: {m.group(0)[:120]!r}")
        bodies = [re.sub(rf"\$(\{{{var}\}}|{var}\b)", v, body) for v in values]
        text = text[:m.start()] + " ; ".join(bodies) + text[m.end():]
    return text


def simple_commands(text: str) -> list[list[str]]:
    """The line's simple commands (split at ; && || | &), each as argv."""
    lex = shlex.shlex(strip_comment(text), posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    commands, cur = [], []
    for tok in lex:
        if tok and set(tok) <= set(";&|()"):
            commands.append(cur)
            cur = []
        else:
            cur.append(tok)
    commands.append(cur)
    return [c for c in commands if c]


def strip_prefixes(argv: list[str]) -> list[str]:
    """Without its environment assignments and wrappers (timeout 570, nice -n 10, env, time)."""
    argv = list(argv)
    while argv:
        if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]) and len(argv) > 1:
            argv.pop(0)
        elif argv[0] in WRAPPERS:
            word = argv.pop(0)
            while argv and argv[0].startswith("-"):
                opt = argv.pop(0)
                if opt == "-n" and word == "nice":
                    argv.pop(0)
            del argv[:WRAPPERS[word]]
        else:
            return argv
    return argv


def expand_vars(word: str) -> str:
    env = {"PWD": str(REPO), "HOME": os.environ.get("HOME", "/root"), "TMPDIR": os.environ.get("TMPDIR", "/tmp")}
    return re.sub(r"\$(?:\{(\w+)\}|(\w+))", lambda m: env.get(m.group(1) or m.group(2), m.group(0)), word)


# ---------------------------------------------------------------------------------------------------- checkers

def check_line(line: DocLine) -> list[str]:
    """Every simple command of a doc line checked; the list of what failed (empty: it runs as written)."""
    text = line.text
    for key, dummy in PLACEHOLDERS.items():
        text = text.replace(key, dummy)
    code = strip_comment(text)
    problems = []
    if m := re.search(r"<[^<>\s][^<>]*>", code):
        problems.append(f"placeholder {m.group(0)} has no dummy in PLACEHOLDERS")
    if "..." in code:
        problems.append("`...` in a command: write a real value")
    if "$(" in code:
        problems.append("`$(...)` in a command: a make expression or command substitution does not run as written")
    if problems:
        return problems
    for argv in simple_commands(expand_loops(code)):
        try:
            check_command([expand_vars(a) for a in strip_prefixes(argv)], in_recipe=False)
        except AssertionError as e:
            problems.append(f"{shlex.join(argv)}: {e}")
    return problems


def check_command(argv: list[str], in_recipe: bool) -> None:
    word = argv[0]
    name = Path(word).name
    if word in NOT_CHECKED:
        return
    if in_recipe and (word in RECIPE_PLUMBING or re.match(r"^\w+=\S*$", word)):
        return
    if name.startswith("python"):
        return check_python(argv[1:])
    if name == "torchrun":
        return check_torchrun(argv[1:])
    if word == "make":
        assert not in_recipe, "a recipe's own make call (make -n already runs those)"
        return check_make(argv[1:])
    if word == "sbatch":
        return check_sbatch(argv[1:])
    if word in ("bash", "sh"):
        return check_script(argv[1])
    if name == "hf":
        return check_hf(argv[1:])
    raise AssertionError(f"no check for {word!r}: check it here, or list it in NOT_CHECKED with the reason")


def check_python(args: list[str]) -> None:
    while args and args[0].startswith("-") and args[0] != "-m":
        args = args[1:]  # interpreter options (-u, -X ...)
    if args and args[0] != "-m":  # a script
        assert (REPO / args[0]).is_file(), f"no script {args[0]}"
        return
    assert len(args) >= 2, "python -m without a module"
    module, rest = args[1], args[2:]
    if module in HYDRA_APPS:
        return check_hydra(module, rest)
    if module in ARGPARSE_APPS:
        return check_argparse(module, rest)
    if module in PLAIN_APPS:
        assert not rest, f"{module} takes no arguments"
        return
    if module in OTHER_MODULES:
        return
    raise AssertionError(f"unknown module {module!r} (HYDRA_APPS, ARGPARSE_APPS, PLAIN_APPS or OTHER_MODULES)")


def check_torchrun(args: list[str]) -> None:
    from torch.distributed.run import get_args_parser

    try:
        ns = get_args_parser().parse_args(args)
    except SystemExit as e:
        raise AssertionError(f"torchrun's parser refused it (exit {e.code})") from None
    assert ns.module, "torchrun without -m: this project runs modules"
    check_python(["-m", ns.training_script, *ns.training_script_args])


def hydra_jobs(config_name: str, overrides: list[str], multirun: bool) -> list[list[str]]:
    """The override list of each job to compose: one for a run; for a sweep (the experiment's hydra.sweeper.params,
    then the line's overrides, the line's winning on the same key, as Hydra's basic sweeper merges them) as many jobs
    as the longest swept key has values, job j taking each swept key's value j (cycling): every value of every key
    composed at least once, without the whole product."""
    parser = OverridesParser.create()
    parsed = parser.parse_overrides(overrides)
    if not multirun:
        assert not any(o.is_sweep_override() for o in parsed), "a sweep (a,b) without -m"
        return [overrides]
    first = [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" if o.is_sweep_override()
             else o.input_line for o in parsed]
    base = compose(config_name=config_name, overrides=first, return_hydra_config=True)
    params = [f"{k}={v}" for k, v in (base.hydra.sweeper.get("params") or {}).items()]
    merged: dict[str, object] = {}
    for o in parser.parse_overrides(params + overrides):
        merged[o.get_key_element()] = o
    values = {k: ([f"{k}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override() else [o.input_line])
              for k, o in merged.items()}
    return [[vals[j % len(vals)] for vals in values.values()] for j in range(max(map(len, values.values())))]


def check_hydra(module: str, args: list[str]) -> None:
    checked_hydra(module, tuple(args))  # (a line that make bench, README and running.md share: composed once)


@functools.cache
def checked_hydra(module: str, args: tuple[str, ...]) -> None:
    from hydra._internal.utils import get_args_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            ns = get_args_parser().parse_args(args)
    except SystemExit as e:
        raise AssertionError(f"Hydra's command-line parser refused it (exit {e.code})") from None
    if ns.help or ns.hydra_help:
        return run_help(module, "--help" if ns.help else "--hydra-help")
    config_name = ns.config_name or HYDRA_APPS[module]
    assert (CONF / f"{config_name}.yaml").is_file(), f"no conf/{config_name}.yaml"
    register_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        try:
            jobs = hydra_jobs(config_name, ns.overrides, ns.multirun)
        except AssertionError:
            raise
        except Exception as e:
            raise AssertionError(f"{type(e).__name__}: {first_line(e)}") from None
        for job in jobs:
            try:
                cfg = compose(config_name=config_name, overrides=job, return_hydra_config=True)
                with open_dict(cfg):
                    del cfg["hydra"]
                OmegaConf.to_container(cfg, resolve=True)
            except Exception as e:
                raise AssertionError(f"{module} ({config_name}) does not compose with {' '.join(job)}: "
                                     f"{type(e).__name__}: {first_line(e)}") from None


def first_line(e: BaseException) -> str:
    return (str(e).strip().split("\n") or [""])[0]


@functools.cache
def run_help(module: str, flag: str) -> None:
    r = subprocess.run([sys.executable, "-m", module, flag], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{module} {flag} exited {r.returncode}: {r.stderr.strip()[-300:]}"


class Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def check_argparse(module: str, args: list[str]) -> None:
    """The app's own parser reads the line's arguments (main() stopped right after parse_args), and `--help` exits
    0; every --flag the line names is in the help text."""
    main = importlib.import_module(ARGPARSE_APPS[module]).main
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed(self)

    def run(argv: list[str]) -> tuple[argparse.ArgumentParser | None, int | None, str]:
        out, saved = io.StringIO(), sys.argv
        sys.argv = [module, *argv]
        try:
            with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), \
                    contextlib.redirect_stderr(out):
                mp.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
                main()
        except Parsed as p:
            return p.parser, None, out.getvalue()
        except SystemExit as e:
            return None, e.code, out.getvalue()
        finally:
            sys.argv = saved
        raise AssertionError(f"{module}'s main() returned without parsing its arguments")

    parser, code, text = run(["--help"])
    assert parser is None and code in (0, None), f"{module} --help exited {code}: {text[-300:]}"
    if {"-h", "--help"} & set(args):
        return
    parser, code, text = run(args)
    assert parser is not None, f"{module}'s parser refused {shlex.join(args)} (exit {code}): {text.strip()[-300:]}"
    helps = parser.format_help() + "".join(
        p.format_help() for a in parser._actions if isinstance(a, argparse._SubParsersAction)
        for p in a.choices.values())
    for flag in (a.split("=")[0] for a in args if a.startswith("--") and a != "--"):
        assert lists(helps, flag), f"{module}'s help does not list {flag}"


def lists(help_text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None


def check_make(args: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    r = subprocess.run(["make", "-n", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"make -n exited {r.returncode}: {r.stderr.strip()[-300:]}"
    recipe = re.sub(r"\\\n\s*", " ", "\n".join(ln for ln in r.stdout.splitlines() if not ln.startswith("make")))
    for line in recipe.splitlines():
        for argv in simple_commands(expand_loops(line)):
            try:
                check_command(strip_prefixes(argv), in_recipe=True)
            except AssertionError as e:
                raise AssertionError(f"make -n {shlex.join(args)} runs `{shlex.join(argv)}`: {e}") from None


def check_script(path: str) -> None:
    assert (REPO / path).is_file(), f"no script {path}"
    r = subprocess.run(["bash", "-n", path], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, f"bash -n {path}: {r.stderr.strip()}"


def check_sbatch(args: list[str]) -> None:
    """sbatch's own options are SLURM's (no sbatch client here; make cluster-test submits the script to a real
    one); the script parses (bash -n) and its arguments compose as its module's overrides."""
    scripts = [i for i, a in enumerate(args) if not a.startswith("-")]
    assert scripts, "sbatch without a script"
    script, rest = args[scripts[0]], args[scripts[0] + 1:]
    check_script(script)
    assert script in SBATCH_SCRIPTS, f"{script}: which module its arguments go to (SBATCH_SCRIPTS)"
    check_python(["-m", SBATCH_SCRIPTS[script], *rest])


@functools.cache
def hf_help(sub: str) -> str:
    r = subprocess.run([str(VENV_BIN / "hf"), sub, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"hf {sub} --help exited {r.returncode}: {r.stderr.strip()[-300:]}"
    return r.stdout


def check_hf(args: list[str]) -> None:
    assert args, "hf without a subcommand"
    text = hf_help(args[0])
    for flag in (a.split("=")[0] for a in args[1:] if a.startswith("--")):
        assert lists(text, flag), f"hf {args[0]} --help does not list {flag}"


# ---------------------------------------------------------------------------------------------------- tests

LINES = doc_lines()


def test_the_docs_have_commands_to_check():
    paths = {line.path for line in LINES}
    assert {"README.md", "docs/running.md", "docs/training.md", "docs/gpu.md"} <= paths
    assert sum("specbench." in line.text for line in LINES) >= 10


@pytest.mark.parametrize("line", LINES, ids=str)
def test_every_doc_command_runs_as_written(line):
    problems = check_line(line)
    assert not problems, f"{line}: {line.text}\n  " + "\n  ".join(problems)


# run before or without the set-up, so on the box's python3 (python3 -m <module>): the venv itself, the registry, and
# make gpu-check's command (a lent GPU box runs it on its own python, no set-up)
SYSTEM_PYTHON_MODULES = {"venv", "pip", "specbench.gpu_check"}


def test_one_convention_for_the_venv():
    """README.md and docs/running.md say once how commands run after `make setup`: on the .venv's executables, written
    `.venv/bin/python`, `.venv/bin/torchrun`, `.venv/bin/hf` (or activated). So no doc line says a bare `python`,
    `torchrun`, `hf` or `pip` (a fresh shell has no Hydra on its python), and `python3` only for SYSTEM_PYTHON_MODULES."""
    bad = [f"{path.name} does not say how commands are run: {phrase!r} missing"
           for path in (REPO / "README.md", REPO / "docs" / "running.md")
           for phrase in ("`.venv/bin/python -m specbench...`", "source .venv/bin/activate")
           if phrase not in path.read_text()]
    for line in LINES:
        code = strip_comment(line.text)
        for key, dummy in PLACEHOLDERS.items():
            code = code.replace(key, dummy)
        for argv in simple_commands(code):
            argv = strip_prefixes(argv)
            word = argv[0]
            if word in ("python", "torchrun", "hf", "pip"):
                bad.append(f"{line}: `{word}` is not the .venv's: write .venv/bin/{word}")
            elif word == "python3" and not (argv[1:2] == ["-m"] and argv[2:3] and argv[2] in SYSTEM_PYTHON_MODULES):
                bad.append(f"{line}: `{shlex.join(argv[:3])}` runs on the box's python: write .venv/bin/python")
    assert not bad, "\n".join(bad)


def test_every_entry_point_is_classified():
    """Each `python -m specbench.X` shim is in exactly one table above, and a Hydra app's config name is its code's."""
    shims = {f"specbench.{p.stem}" for p in (REPO / "specbench").glob("*.py")
             if "__main__" in p.read_text() and p.stem != "__init__"} | {"specbench.train"}
    tables = [HYDRA_APPS, ARGPARSE_APPS, PLAIN_APPS]
    for shim in sorted(shims):
        assert sum(shim in t for t in tables) == 1, f"{shim}: put it in one of HYDRA_APPS, ARGPARSE_APPS, PLAIN_APPS"
    assert set().union(*tables) <= shims
    for module, config_name in HYDRA_APPS.items():
        shim = REPO / "specbench" / (f"{module.split('.')[1]}.py" if module != "specbench.train"
                                      else "train/__main__.py")
        impl = re.search(r"from (specbench\.[\w.]+) import main", shim.read_text()).group(1)
        code = (REPO / (impl.replace(".", "/") + ".py")).read_text()
        names = set(re.findall(r"config_name=\"(\w+)\"", code)) | set(re.findall(r"\bentry\([^\n]*?, \"(\w+)\"\)", code))
        if re.search(r"\bmain = entry\(", code) and not re.search(r"\bmain = entry\([^\n]*, \"\w+\"\)", code):
            names.add("config")
        assert config_name in names, f"{module} composes {names}, not {config_name}"
