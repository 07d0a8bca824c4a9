"""The user documentation against the code: every ``kvlens ...`` command line in README.md and
docs/ (outside docs/lab-notes/, which keeps dated history as it was) names a real command, real
options of that command and values that resolve (presets, engine settings, targets, choices);
relative links and their anchors resolve; the reference pages' usage blocks equal the current
``--help`` (regenerate them with ``python docs/gen_reference.py``). Nothing is run: commands are
checked against the click command that ``kvlens`` builds.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import typer

import kvlens.research  # noqa: F401  (the CLI loads the research presets the docs name)
from kvlens.cli import app
from kvlens.config import is_engine_setting, preset
from kvlens.deploy import engine_config
from kvlens.deploy.targets import TARGETS
from kvlens.errors import KvlensError
from kvlens.evaluation import parse_evals
from kvlens.evaluation.baselines import is_baseline

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LAB_NOTES = DOCS / "lab-notes"
README_LIMIT = 8704  # bytes: "a README read in five minutes" (issue #37), ~8.5 KiB
# Pages linked before they are written (by another change); a link to one may dangle until then.
HELP_OPTIONS = ("--help",)  # click adds these to every command outside its params


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _load_generator()
help_text = cache(gen.help_text)  # one subprocess per command for the whole file


def user_pages() -> list[Path]:
    """README.md and docs/**.md, without the lab notes."""
    pages = [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))
    return [p for p in pages if LAB_NOTES not in p.parents]


def all_pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md"] + sorted(DOCS.rglob("*.md"))


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# -- markdown -----------------------------------------------------------------------------

_FENCE = re.compile(r"^(\s*)(```|~~~)")


@dataclass(frozen=True)
class Block:
    info: str
    lines: tuple[tuple[int, str], ...]  # (line number, text)


def split_markdown(text: str) -> tuple[list[tuple[int, str]], list[Block]]:
    """(prose lines, fenced code blocks) with 1-based line numbers."""
    prose, blocks, inside, info, body = [], [], None, "", []
    for number, line in enumerate(text.splitlines(), 1):
        fence = _FENCE.match(line)
        if inside is None and fence:
            inside, info, body = fence.group(2), line.strip()[3:].strip(), []
        elif inside is not None and fence and line.strip().startswith(inside):
            blocks.append(Block(info, tuple(body)))
            inside = None
        elif inside is not None:
            body.append((number, line))
        else:
            prose.append((number, line))
    return prose, blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    prose, _ = split_markdown(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose:
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", line))
    return frozenset(found)


_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"(`+)([^`]+?)\1")


def links(path: Path) -> list[tuple[int, str]]:
    prose, _ = split_markdown(path.read_text(encoding="utf-8"))
    found = []
    for number, line in prose:
        for target in _LINK.findall(_CODE_SPAN.sub("", line)):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, mailto:, ...
                found.append((number, target))
    return found


def broken_link(page: Path, target: str) -> str | None:
    file_part, _, anchor = target.partition("#")
    dest = (page.parent / file_part).resolve() if file_part else page
    if not dest.exists():
        return f"no such file {file_part}"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"no heading #{anchor} in {_rel(dest)}"
    return None


# -- command lines ------------------------------------------------------------------------

@dataclass(frozen=True)
class CommandLine:
    page: Path
    line: int
    text: str
    complete: bool  # a whole command in a code block (required arguments given)

    def __str__(self) -> str:
        return f"{_rel(self.page)}:{self.line}: {self.text}"


def _in_generated_block(page_text: str) -> set[int]:
    """Line numbers inside generated --help blocks (their usage lines are not commands)."""
    skip, inside = set(), False
    for number, line in enumerate(page_text.splitlines(), 1):
        if line.startswith("<!-- BEGIN kvlens"):
            inside = True
        elif line.startswith("<!-- END kvlens"):
            inside = False
        elif inside:
            skip.add(number)
    return skip


def command_lines(page: Path) -> list[CommandLine]:
    text = page.read_text(encoding="utf-8")
    prose, blocks = split_markdown(text)
    generated = _in_generated_block(text)
    found = []
    for block in blocks:
        pending, start = "", 0
        for number, line in block.lines:
            if number in generated:
                continue
            if not pending:
                start = number
            pending += line.rstrip()
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            stripped = re.sub(r"^\s*\$\s+", "", pending).strip()
            words = stripped.split()
            while words and re.match(r"^[A-Z_][A-Z0-9_]*=\S*$", words[0]):  # VAR=value prefixes
                words.pop(0)
            if words and words[0] == "kvlens":
                found.append(CommandLine(page, start, " ".join(words), True))
            pending = ""
    # A code span may wrap onto the next line of its paragraph: search the prose as one text.
    numbers = [number for number, _ in prose]
    text = "\n".join(line for _, line in prose)
    for match in _CODE_SPAN.finditer(text):
        span = " ".join(match.group(2).split())
        if span.startswith("kvlens ") and not span.startswith("kvlens ."):
            line = numbers[text.count("\n", 0, match.start())]
            found.append(CommandLine(page, line, span, False))
    return found


@cache
def cli():
    """The click group ``kvlens`` runs (typer may vendor its own click: no click types here)."""
    return typer.main.get_command(app)


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _cache_name(name: str, calibrated: bool) -> None:
    """A name ``generate --preset`` accepts: a preset or an engine setting. With
    ``--calibration`` on the line, calibrated forms (``@head``, ``:pP``) are checked without
    their calibration (reading the capture would need the file)."""
    if is_engine_setting(name):
        if calibrated:
            name = re.sub(r":p[\d.]+(?=:|$)", "", name.replace("@head", ""))
        engine_config(name)
    else:
        preset(name)


def _compare_item(name: str, calibrated: bool) -> None:
    if is_baseline(name) or name.endswith(".json"):
        return
    _cache_name(name, calibrated)


def _check_value(command: str, option: str, value: str, calibrated: bool = False) -> str | None:
    try:
        if (command, option) == ("generate", "--preset"):
            _cache_name(value, calibrated)
        elif (command, option) == ("generate", "--compare"):
            for item in value.split(","):
                _compare_item(item.strip(), calibrated)
        elif (command, option) == ("generate", "--config") and not value.endswith(".json"):
            return f"--config takes a config file (.json), got {value!r}"
        elif (command, option) == ("generate", "--eval"):
            parse_evals(value)
        elif (command, option) == ("recommend", "--target") and value not in TARGETS:
            return f"--target {value!r} is not one of {', '.join(TARGETS)}"
    except KvlensError as exc:
        return f"{option} {value}: {exc}"
    return None


def _number_kind(param):
    """int or float when the option takes a number (typer >= 0.29 describes the type by its
    annotation, older typer by a click type), else None."""
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if annotation in (int, float):
        return annotation
    name = type(getattr(param, "type", None)).__name__
    return {"IntParamType": int, "IntRange": int, "FloatParamType": float,
            "FloatRange": float}.get(name)


def _bad_number(param, value: str) -> str | None:
    kind = _number_kind(param)
    if kind is None:
        return None
    try:
        number = kind(value)
    except ValueError:
        return f"not {'an integer' if kind is int else 'a number'}"
    low = getattr(param, "min", getattr(getattr(param, "type", None), "min", None))
    high = getattr(param, "max", getattr(getattr(param, "type", None), "max", None))
    if (low is not None and number < low) or (high is not None and number > high):
        return f"outside [{low}, {high}]"
    return None


def _is_option(param) -> bool:
    return param.param_type_name == "option"


def _is_argument(param) -> bool:
    return param.param_type_name == "argument"


def problems(cmd_line: CommandLine) -> list[str]:
    """What in ``cmd_line`` the CLI would refuse (before running anything)."""
    try:
        tokens = shlex.split(cmd_line.text, comments=True)
    except ValueError as exc:
        return [f"cannot split: {exc}"]
    tokens = tokens[1:]  # "kvlens"
    group = cli()
    if not tokens:
        return []
    if tokens[0].startswith("-"):
        allowed = {o for p in group.params for o in p.opts + p.secondary_opts} | set(HELP_OPTIONS)
        return [f"unknown option {t} of kvlens" for t in tokens if t not in allowed]
    name, rest = tokens[0], tokens[1:]
    if name not in group.commands:
        return [f"unknown command {name!r}; commands: {', '.join(group.commands)}"]
    cmd = group.commands[name]
    options = {o: p for p in cmd.params if _is_option(p)
               for o in p.opts + p.secondary_opts}
    errors, positionals, given, asked_help = [], [], set(), False
    calibrated = any(t.split("=", 1)[0] == "--calibration" for t in rest)
    i = 0
    while i < len(rest):
        token = rest[i]
        if token == "--":
            positionals += rest[i + 1:]
            break
        if not token.startswith("-") or token == "-" or _is_number(token):
            positionals.append(token)
            i += 1
            continue
        opt, eq, value = token.partition("=")
        if opt not in options and not token.startswith("--") and token[:2] in options:
            opt, eq, value = token[:2], "=", token[2:]  # -b3.0
        param = options.get(opt)
        if param is None and opt in HELP_OPTIONS:
            asked_help = True
            i += 1
            continue
        if param is None:
            errors.append(f"{name} has no option {opt}")
            i += 1
            continue
        given.add(param.name)
        if param.is_flag or param.count:
            if eq:
                errors.append(f"{opt} is a flag and takes no value")
            i += 1
            continue
        if not eq:
            if i + 1 >= len(rest):
                errors.append(f"{opt} needs a value")
                break
            value = rest[i + 1]
            i += 1
        i += 1
        if why := _bad_number(param, value):
            errors.append(f"{opt} {value}: {why}")
            continue
        long = next((o for o in param.opts if o.startswith("--")), opt)
        if why := _check_value(name, long, value, calibrated):
            errors.append(why)
    arguments = [p for p in cmd.params if _is_argument(p)]
    capacity = float("inf") if any(a.nargs == -1 for a in arguments) else len(arguments)
    if len(positionals) > capacity:
        errors.append(f"{name} takes {capacity} argument(s), got {positionals}")
    if cmd_line.complete and not asked_help:
        required = sum(1 for a in arguments if a.required)
        if len(positionals) < required:
            errors.append(f"{name} needs {required} argument(s) "
                          f"({', '.join(a.name.upper() for a in arguments)}), got {positionals}")
        for p in cmd.params:
            if _is_option(p) and p.required and p.name not in given:
                errors.append(f"{name} requires {p.opts[0]}")
    return errors


# -- tests --------------------------------------------------------------------------------

def _all_command_lines() -> list[CommandLine]:
    return [c for page in user_pages() for c in command_lines(page)]


def test_the_docs_have_command_lines_to_check():
    found = _all_command_lines()
    assert len(found) >= 20
    assert {c.text.split()[1] for c in found} >= set(cli().commands)


def test_every_command_line_parses_against_the_cli():
    bad = [f"{c}\n    -> {'; '.join(p)}" for c in _all_command_lines() if (p := problems(c))]
    assert not bad, "command lines the CLI would refuse:\n" + "\n".join(bad)


@pytest.mark.parametrize("text, complete, expect", [
    ("kvlens recommend run.h5 -b 3.0 --window-dtype float8_e4m3fn", True, None),
    ("kvlens recommend run.h5 --budget", True, "no option --budget"),
    ("kvlens recommend --target llama.cpp --max-kld 0.01", False, None),
    ("kvlens recommend --target llama.cpp --max-kld 0.01", True, "needs 1 argument"),
    ("kvlens recommend run.h5 --target llamacpp", True, "--target 'llamacpp'"),
    ("kvlens recommend run.h5 --tokens many", True, "--tokens many"),
    ("kvlens recommend run.h5 --select", True, "no option --select"),
    ("kvlens recommend run.h5 --samples 0", True, "--samples 0: outside"),
    ("kvlens generate --compare kivi-2,kivi-3 --eval kld", True, "kivi-3"),
    ("kvlens generate --compare llamacpp:q8_0/q4_0,vllm:fp8_e4m3,r3.json,hf-fp8 --eval kld",
     True, None),
    ("kvlens generate --compare llamacpp:q9_0 --eval kld", True, "q9_0"),
    ("kvlens generate --compare vllm:fp8_e4m3@head --eval kld", True, "--calibration"),
    ("kvlens generate --compare vllm:fp8_e4m3@head,vllm:fp8_e4m3:p99.9 --calibration run.h5 "
     "--eval kld", True, None),
    ("kvlens generate --preset kivi-2 --eval kld,bleu", True, "bleu"),
    ("kvlens generate --config kivi-2 --prompt hi", True, "config file"),
    ("kvlens plot-outliers run.h5", True, "requires --out"),
    ("kvlens plot-outliers run.h5 -o figs --json=yes", True, "is a flag"),
    ("kvlens frobnicate run.h5", True, "unknown command"),
    ("kvlens recommend --help", True, None),
    ("kvlens --version", True, None),
    ("kvlens --verbose", True, "unknown option --verbose"),
])
def test_the_checker_refuses_what_the_cli_refuses(text, complete, expect):
    found = problems(CommandLine(ROOT / "README.md", 1, text, complete))
    if expect is None:
        assert found == []
    else:
        assert any(expect in p for p in found), found


def test_command_lines_are_found_in_code_blocks_and_spans(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("Run `kvlens capture -o a.h5` first, then `kvlens\nreport .`.\n\n```bash\n$ OMP_NUM_THREADS=1 kvlens "
                    "recommend a.h5 \\\n    -b 3.0   # note\nls\n```\n", encoding="utf-8")
    found = command_lines(page)
    assert [(c.line, c.text, c.complete) for c in found] == [
        (5, "kvlens recommend a.h5 -b 3.0 # note", True),
        (1, "kvlens capture -o a.h5", False),
        (1, "kvlens report .", False)]
    assert all(problems(c) == [] for c in found)


def test_relative_links_resolve():
    bad = [f"{_rel(page)}:{n}: {target} ({why})" for page in all_pages() if page.exists()
           for n, target in links(page) if (why := broken_link(page, target))]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_slugs_follow_github():
    assert slug("Headline at today's defaults (both models, 2026-12-03)") == \
        "headline-at-todays-defaults-both-models-2026-12-03"
    assert slug("JSON (`--json`)") == "json---json"
    assert slug("8-bit group metadata") == "8-bit-group-metadata"


@pytest.mark.parametrize("command", gen.commands())
def test_reference_page_matches_help(command):
    path = gen.page_path(command)
    assert path.exists(), f"no {_rel(path)}: run python docs/gen_reference.py"
    shown = gen.current_block(path.read_text(encoding="utf-8"), command)
    assert shown is not None, f"{_rel(path)} lacks the generated block's markers"
    assert shown == help_text(command), \
        f"{_rel(path)} is stale: run python docs/gen_reference.py"


def test_docs_named_in_help_exist():
    """--help cites docs pages (e.g. docs/recommend.md#fp8-windows): they must resolve."""
    bad = []
    for command in gen.commands():
        text = re.sub(r"\s*│\s*", " ", help_text(command))
        for target in re.findall(r"docs/[\w./-]+?\.md(?:#[\w-]+)?", text):
            if (why := broken_link(ROOT / "README.md", target)):
                bad.append(f"kvlens {command} --help: {target} ({why})")
    assert not bad, "\n".join(bad)


def test_python_imports_in_docs_resolve():
    """The names the Python examples import exist (modules move; the examples must follow)."""
    bad, seen = [], 0
    for page in user_pages():
        _, blocks = split_markdown(page.read_text(encoding="utf-8"))
        for block in blocks:
            if block.info != "python":
                continue
            for number, line in block.lines:
                found = re.match(r"^\s*from (kvlens[\w.]*) import ([\w, ]+)", line)
                if not found:
                    continue
                seen += 1
                module, names = found.group(1), [n.strip() for n in found.group(2).split(",")]
                try:
                    imported = importlib.import_module(module)
                except ImportError as exc:
                    bad.append(f"{_rel(page)}:{number}: {module}: {exc}")
                    continue
                bad += [f"{_rel(page)}:{number}: {module} has no {n}" for n in names
                        if not hasattr(imported, n)]
    assert seen >= 3
    assert not bad, "\n".join(bad)


def test_readme_is_short():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes; keep it under {README_LIMIT}"


USER_PATH_LIMIT = 160 * 1024  # README + docs/*.md + docs/deploy/*.md (issue 48)


def test_the_user_path_stays_small():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "docs" / "deploy").glob("*.md"))]
    size = sum(len(f.read_bytes()) for f in files)
    assert size <= USER_PATH_LIMIT, (f"the user-path docs are {size} bytes; keep them under "
                                     f"{USER_PATH_LIMIT} (experiment logs go to docs/lab-notes/)")
