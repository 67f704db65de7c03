"""Digests of the tables every shipped scenario and sweep writes, to show that a change
left kvsim's results byte for byte as they were.

Each scenario under scenarios/ (and scenarios/claims/) runs with `kvsim run`, each sweep
under scenarios/sweeps/ with `kvsim sweep --quick`, in a fresh process whose PYTHONPATH
is the checkout named by --repo; the SHA-256 of every table it writes (summary.csv and
.json, timeseries.parquet, requests.parquet, replica_summary.csv and .json, the sweep's
summary.csv and results.parquet) goes into one JSON file. Figures and run.json (wall
times, versions) are left out. A scenario whose input file is absent (a trace under the
data folder) is recorded as skipped with kvsim's message.

    python scripts/snapshot_outputs.py --out /tmp/new.json              # this checkout
    python scripts/snapshot_outputs.py --repo /path/to/other --out /tmp/old.json
    python scripts/snapshot_outputs.py --compare /tmp/old.json /tmp/new.json
    python scripts/snapshot_outputs.py --against /path/to/other         # both, then compare

--exact-steps runs the scenarios on the plain step-by-step path instead. Takes about two
minutes per checkout on two cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLES = (
    "summary.csv",
    "summary.json",
    "timeseries.parquet",
    "requests.parquet",
    "replica_summary.csv",
    "replica_summary.json",
    "stages.csv",
    "stages.json",
    "results.parquet",
)


def shipped(repo: Path) -> list[tuple[str, list[str]]]:
    """(name, `kvsim` arguments before --out) for every shipped scenario and sweep."""
    jobs = []
    for path in sorted((repo / "scenarios").glob("*.yaml")) + sorted((repo / "scenarios" / "claims").glob("*.yaml")):
        jobs.append((str(path.relative_to(repo)), ["run", str(path), "--quiet"]))
    for path in sorted((repo / "scenarios" / "sweeps").glob("*.yaml")):
        jobs.append((str(path.relative_to(repo)), ["sweep", str(path), "--quick"]))
    return jobs


def digest_folder(folder: Path) -> dict[str, str]:
    return {
        name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in TABLES if (folder / name).is_file()
    }


def snapshot(repo: Path, exact_steps: bool = False) -> dict:
    repo = repo.resolve()
    env = {**os.environ, "PYTHONPATH": str(repo)}
    env.pop("KVSIM_EXACT_STEPS", None)
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvsim-snapshot-") as tmp:
        for i, (name, args) in enumerate(shipped(repo)):
            folder = Path(tmp) / str(i)
            extra = ["--exact-steps"] if exact_steps and args[0] == "run" else []
            done = subprocess.run(
                [sys.executable, "-m", "kvsim.cli", *args, *extra, "--force", "--out", str(folder)],
                capture_output=True,
                text=True,
                cwd=repo,
                env=env,
            )
            if done.returncode == 2 and "not found" in done.stderr:
                out[name] = {"skipped": done.stderr.strip()}
            elif done.returncode != 0:
                raise SystemExit(f"{name}: exit status {done.returncode}\n{done.stderr}")
            else:
                out[name] = digest_folder(folder)
            print(f"{name}: {', '.join(out[name]) if 'skipped' not in out[name] else 'skipped'}", file=sys.stderr)
    return {"repo": str(repo), "exact_steps": exact_steps, "outputs": out}


def compare(old: dict, new: dict) -> list[str]:
    """Every difference between two snapshots, one line each (none: identical)."""
    problems = []
    a, b = old["outputs"], new["outputs"]
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            problems.append(f"{name}: only in {'new' if name in b else 'old'}")
            continue
        if "skipped" in a[name] or "skipped" in b[name]:
            if a[name] != b[name]:
                problems.append(f"{name}: skipped in one only")
            continue
        for table in sorted(set(a[name]) | set(b[name])):
            if a[name].get(table) != b[name].get(table):
                problems.append(f"{name}: {table} differs")
    return problems


def report(old: dict, new: dict) -> int:
    problems = compare(old, new)
    tables = sum(len(v) for v in new["outputs"].values() if "skipped" not in v)
    skipped = [k for k, v in new["outputs"].items() if "skipped" in v]
    for line in problems:
        print(line)
    print(
        f"{'DIFFERENT' if problems else 'identical'}: {len(new['outputs'])} scenarios and sweeps, "
        f"{tables} tables{f'; skipped (input absent): {skipped}' if skipped else ''}"
    )
    return 1 if problems else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=ROOT, help="the checkout to run [default: this one]")
    ap.add_argument("--out", type=Path, help="write the snapshot here")
    ap.add_argument("--exact-steps", action="store_true")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"))
    ap.add_argument(
        "--against", type=Path, metavar="OTHER_REPO", help="snapshot OTHER_REPO and --repo, then compare them"
    )
    args = ap.parse_args()
    if args.compare:
        old, new = (json.loads(p.read_text()) for p in args.compare)
        return report(old, new)
    if args.against:
        old = snapshot(args.against, args.exact_steps)
        new = snapshot(args.repo, args.exact_steps)
        if args.out:
            args.out.write_text(json.dumps({"old": old, "new": new}, indent=1))
        return report(old, new)
    snap = snapshot(args.repo, args.exact_steps)
    text = json.dumps(snap, indent=1)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
