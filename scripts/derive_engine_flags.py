"""Derive the command-line flags of the engine releases kvsim follows.

Reads the sources of vLLM 0.33.0 (pip download --no-deps vllm==0.33.0, unpacked) and
SGLang 0.5.23's own parser (installed: kvsim.engines.sglang_reference says how) and writes
``kvsim/data/engine_flags.json``: for each release, every flag its server accepts
(long names and their short aliases), from

* vLLM: the ``add_argument`` calls of vllm/engine/arg_utils.py (EngineArgs and
  AsyncEngineArgs), the fields of FrontendArgs and BaseFrontendArgs in
  vllm/entrypoints/common/cli_args.py (flags named after the fields) and the
  ``add_argument`` calls of its make_arg_parser (--headless, --api-server-count, ...);
  vLLM's parser also takes every boolean as --no-NAME and -O<level> for
  --optimization-level (vllm/utils/argparse_utils.py), which kvsim handles itself.
* SGLang: the parser `sglang serve` builds (python/sglang/srt/server_args.py,
  prepare_server_args: ServerArgs.add_cli_args). In 0.5.23 most flags are fields of the
  namespaces in srt/arg_groups/fields/ turned into flags by add_cli_args_from_dataclass
  (arg_groups/arg_utils.py), so the parser is built and its actions read rather than
  the source searched: the first long option string is the flag's name, the others its
  aliases; a --no-NAME of a BooleanOptionalAction is recorded as `negatable`.

A flag is a switch (takes no value) where its field is annotated bool: EngineArgs,
AsyncEngineArgs and the frontend dataclasses for vLLM (argparse's BooleanOptionalAction,
so --NAME and --no-NAME), and vLLM's make_arg_parser switches (--headless, --grpc); for
SGLang where its action takes no argument (nargs 0: store_true, the deprecated
switches, BooleanOptionalAction).

kvsim's table of what each flag sets (kvsim.config.engine_flags) uses this list to tell an
unknown flag from one it accepts and ignores, and to know which flags take a value.
Output is deterministic (sorted).

Usage: python scripts/derive_engine_flags.py VLLM_DIR [OUTPUT_JSON]
  (VLLM_DIR holds vllm/; run with SGLang 0.5.23 importable)
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

ARG = re.compile(r'add_argument\(\s*((?:"-{1,2}[A-Za-z0-9-]+"\s*,\s*)+)')
NAME = re.compile(r'"(-{1,2}[A-Za-z0-9-]+)"')


def add_argument_flags(text: str) -> list[list[str]]:
    """Every add_argument call's flag names, the long name first."""
    return [NAME.findall(group) for group in ARG.findall(text)]


def fields(text: str, classes: tuple[str, ...]) -> dict[str, str]:
    """{--flag-name: annotation} of the dataclasses' fields."""
    out = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and node.name in classes:
            for st in node.body:
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                    out["--" + st.target.id.replace("_", "-")] = ast.unparse(st.annotation).replace(" ", "")
    return out


def release(groups: list[list[str]], annotations: dict[str, str], switches=()) -> dict[str, dict]:
    """{long name: {aliases, switch}}, sorted."""
    out: dict[str, set[str]] = {}
    for names in groups:
        longs = [n for n in names if n.startswith("--")]
        head = longs[0] if longs else names[0]
        out.setdefault(head, set()).update(n for n in names if n != head)
    return {
        k: {
            "aliases": sorted(v),
            "switch": k in switches or annotations.get(k) in ("bool", "bool|None", "Optional[bool]"),
        }
        for k, v in sorted(out.items())
    }


def sglang_release() -> dict[str, dict]:
    """Every flag of the installed SGLang's `sglang serve` parser."""
    import argparse

    from kvsim.engines.sglang_reference import SGLANG_VERSION, load_sglang

    load_sglang()  # the pinned release, importable on a CPU-only machine
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    out = {}
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or longs[0] == "--help":
            continue
        negations = {o for o in longs if isinstance(action, argparse.BooleanOptionalAction) and o.startswith("--no-")}
        entry = {
            "aliases": sorted(o for o in action.option_strings if o != longs[0] and o not in negations),
            "switch": action.nargs == 0,
        }
        if negations:
            entry["negatable"] = True
        out[longs[0]] = entry
    assert SGLANG_VERSION == "0.5.23"
    return dict(sorted(out.items()))


def main(vllm_dir: Path, out: Path) -> None:
    engine = (vllm_dir / "vllm/engine/arg_utils.py").read_text()
    frontend = (vllm_dir / "vllm/entrypoints/common/cli_args.py").read_text()
    front = fields(frontend, ("BaseFrontendArgs", "FrontendArgs"))
    vllm = add_argument_flags(engine) + add_argument_flags(frontend) + [[k] for k in front]
    vllm_types = fields(engine, ("EngineArgs", "AsyncEngineArgs")) | front
    data = {
        "format": "kvsim-engine-flags/2",
        "source": "the releases' own argument parsers, read by scripts/derive_engine_flags.py",
        "vllm 0.33.0": release(vllm, vllm_types, ("--headless", "--grpc")),
        "sglang 0.5.23": sglang_release(),
    }
    out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}: {len(data['vllm 0.33.0'])} vLLM flags, {len(data['sglang 0.5.23'])} SGLang flags")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(
        Path(sys.argv[1]),
        Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).parent.parent / "kvsim/data/engine_flags.json",
    )
