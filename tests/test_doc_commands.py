"""The commands the README and the documentation show work as written, so that a renamed
command, flag, scenario or script breaks the suite rather than a reader's first try.

- Every fenced shell block runs, in order, in a fresh folder holding a copy of
  scenarios/ whose workloads are cut to a few requests (`--num-requests N` in a command
  is cut the same way; `kvsim reproduce` gets its documented `--quick`). Placeholders
  for a trace get a small trace of that format. The README's quick start is run by
  tests/test_docs.py, so blocks that repeat it are not run twice. A `vllm serve` line is
  read by kvsim's own parser of vLLM's flags, as `vllm_args:` would read it. Runs too
  long for the suite (`kvsim reproduce` of every claim) are parsed only: the command,
  its options and their values.
- Every other `kvsim COMMAND --flag` the pages name, in a sentence or a synopsis,
  names a command that exists and options it has; every `python scripts/...` or
  `benchmarks/...` and `bash scripts/...` names a file that exists and flags it reads;
  every scenario path they name exists.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import click
import pytest
import yaml

from helpers import kvsim
from kvsim.cli.app import cli
from kvsim.config import engine_flags

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = re.compile(r"^```(?:sh|bash|shell|console)\n(.*?)^```", re.S | re.M)
FEW = 24  # requests per scenario and per --num-requests in the copies
PARSE_ONLY = {("reproduce",), ("reproduce", "--quick")}  # every claim at full size: minutes
TRACES = {"TRACE", "path/to/mooncake_synthetic_trace.jsonl"}


def block_commands(text: str) -> list[list[str]]:
    """Each fenced shell block's commands as words, comments dropped, continued lines joined."""
    blocks = []
    for body in SHELL.findall(text):
        lines = body.replace("\\\n", " ").splitlines()
        commands = [shlex.split(line, comments=True) for line in lines]
        blocks.append([words for words in commands if words])
    return blocks


def readme_quick_start() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- quick start", 1)[1]
    return block_commands(block[block.index("\n") + 1 :])[0]


def fenced() -> list[tuple[str, int, list[list[str]]]]:
    """(page, block number, commands) for every block not already run elsewhere."""

    def key(commands):
        return tuple(tuple(c) for c in commands if c[0] != "pip")

    seen, found = {key(readme_quick_start())}, []
    for page in PAGES:
        for i, commands in enumerate(block_commands(page.read_text())):
            if key(commands) in seen:
                continue
            seen.add(key)
            found.append((page.relative_to(ROOT).as_posix(), i, commands))
    return found


def test_the_pages_have_blocks_to_run():
    runnable = [c for _, _, cmds in fenced() for c in cmds if c[0] == "kvsim"]
    assert len(runnable) >= 5, runnable


def small_copy(folder: Path) -> None:
    """scenarios/ beside the commands, every workload cut to FEW requests."""
    for src in sorted((ROOT / "scenarios").rglob("*.yaml")):
        dst = folder / "scenarios" / src.relative_to(ROOT / "scenarios")
        dst.parent.mkdir(parents=True, exist_ok=True)
        text = src.read_text()
        doc = yaml.safe_load(text)
        work = doc.get("workload") if isinstance(doc, dict) else None
        if isinstance(work, dict) and isinstance(work.get("num_requests"), int) and work["num_requests"] > FEW:
            work["num_requests"] = FEW
            text = yaml.safe_dump(doc, sort_keys=False)
        dst.write_text(text)


def small_trace(path: Path) -> None:
    """A few requests in Mooncake's published format, sharing their first blocks."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        {"timestamp": 250 * i, "input_length": 1500 + 100 * (i % 4), "output_length": 20, "hash_ids": [0, 1, 2 + i % 5]}
        for i in range(40)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def smaller(words: list[str]) -> list[str]:
    """The command at the suite's scale: --num-requests cut to FEW, reproduce --quick."""
    words = [str(FEW) if i and words[i - 1] == "--num-requests" else w for i, w in enumerate(words)]
    if words[1] == "reproduce" and "--quick" not in words:
        words.append("--quick")
    return words


def parse(words: list[str]) -> None:
    """Parse `kvsim ...` as the command line would, running nothing: a misspelt command,
    option or value fails here."""
    assert words[1] in cli.commands, words
    cli.commands[words[1]].make_context(f"kvsim {words[1]}", list(words[2:])).close()


@pytest.mark.parametrize("page, index, commands", fenced(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_shell_block_runs_as_written(page, index, commands, tmp_path, monkeypatch):
    small_copy(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVSIM_CHECK_INVARIANTS", raising=False)  # what runs, not its steps
    for words in commands:
        words = [("trace.jsonl" if w in TRACES else w) for w in words]
        if "trace.jsonl" in words and not (tmp_path / "trace.jsonl").exists():
            small_trace(tmp_path / "trace.jsonl")
        if words[0] == "vllm":
            engine_flags.parse(shlex.join(words), "vllm", page, f"block {index}")
        elif words[0] == "kvsim" and tuple(words[1:]) in PARSE_ONLY:
            parse(words)
        elif words[0] == "kvsim":
            code, out, err = kvsim(*smaller(words)[1:])
            assert code == 0, (page, shlex.join(words), err[-2000:])
        else:  # an install or a build, after any settings of the environment (NAME=value)
            command = [w for w in words if not re.fullmatch(r"[A-Z_]+=\S*", w)]
            assert command[0] in {"pip", "mkdocs", "pytest"}, (page, shlex.join(words))


# --- commands named in sentences and synopses ------------------------------------
INLINE = re.compile(r"`([^`\n]+)`")
KVSIM = re.compile(r"(?:\$ )?kvsim ((?:--?[\w-]+|[a-z][\w-]*)(?:[^`\n]*))")
SCRIPT = re.compile(r"(?:python|bash) ((?:scripts|benchmarks)/[\w./-]+)((?: [^`\n]*)?)")
SCENARIO = re.compile(r"(?<![\w/])((?:scenarios|tests/data)/[\w./-]+\.(?:yaml|yml))")


def mentions(text: str) -> list[str]:
    """Inline code spans and the lines of fenced blocks (a synopsis's continuation lines
    are joined to the command they continue)."""
    spans = [m.group(1) for m in INLINE.finditer(re.sub(r"```.*?```", " ", text, flags=re.S).replace("\n", " "))]
    lines = []
    for body in re.findall(r"```[\w-]*\n(.*?)```", text, flags=re.S):
        for line in body.splitlines():
            if line.startswith(" ") and lines and line.strip().startswith(("[", "--", "(")):
                lines[-1] += " " + line.strip()
            else:
                lines.append(line)
    return spans + lines


def options(command: click.Command) -> set[str]:
    return {o for p in command.params for o in (*p.opts, *p.secondary_opts)} | {"--help", "-h"}


def named_commands() -> list[tuple[str, str]]:
    return [
        (page.relative_to(ROOT).as_posix(), m.group(1))
        for page in PAGES
        for text in mentions(page.read_text())
        if (m := KVSIM.match(text.strip()))
    ]


def test_every_kvsim_command_named_exists_with_the_options_named():
    wrong = []
    for page, rest in named_commands():
        word = rest.split()[0]
        if word.startswith("-"):
            flags = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", rest))
            wrong += [f"{page}: kvsim {f}" for f in flags - options(cli)]
            continue
        command = cli.commands.get(word)
        if command is None:
            if word.isupper():  # kvsim COMMAND --help
                continue
            wrong.append(f"{page}: kvsim {word} is no command")
            continue
        flags = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", rest.split("&&")[0].split(" # ")[0]))
        wrong += [f"{page}: kvsim {word} {f}" for f in sorted(flags - options(command))]
    assert not wrong, wrong
    assert len(named_commands()) > 40


def test_every_script_and_scenario_named_exists():
    wrong, scripts = [], 0
    for page in PAGES:
        for text in mentions(page.read_text()):
            for m in SCRIPT.finditer(text):
                scripts += 1
                path = ROOT / m.group(1)
                if not path.is_file():
                    wrong.append(f"{page.name}: {m.group(1)} does not exist")
                    continue
                source = path.read_text()
                wrong += [
                    f"{page.name}: {m.group(1)} reads no {f}"
                    for f in re.findall(r"(?<![\w-])--[a-z][\w-]*", m.group(2))
                    if f'"{f}"' not in source and f"'{f}'" not in source and f" {f}" not in source
                ]
            wrong += [
                f"{page.name}: {s} does not exist"
                for s in SCENARIO.findall(text)
                if not (ROOT / s).is_file() and "<" not in s
            ]
    assert not wrong, wrong
    assert scripts >= 10
