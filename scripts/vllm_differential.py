"""Count what the differential test compares: kvsim's `vllm-v1` rules against vLLM
0.33.0's own scheduler on the same streams as tests/test_vllm_differential.py (300
random streams and every shipped scenario's), and print the totals for docs/engines.md.

    python scripts/vllm_differential.py      # needs the kvsim[vllm] extra and vLLM
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_vllm_differential import SCENARIOS, random_setup  # noqa: E402

from kvsim.sim.differential import compare, random_stream, run_native, run_reference, scenario_stream  # noqa: E402


def main() -> None:
    cases = []
    for seed in range(300):
        rng = np.random.default_rng(seed)
        setup = random_setup(rng)
        cases.append((f"seed {seed}", random_stream(rng, setup, 20), setup))
    cases += [(p.stem, *scenario_stream(p)) for p in SCENARIOS]
    steps = requests = preemptions = hits = disagreements = 0
    start = time.perf_counter()
    native_s = reference_s = 0.0
    for name, stream, setup in cases:
        t0 = time.perf_counter()
        native = run_native(stream, setup)
        t1 = time.perf_counter()
        reference = run_reference(stream, setup)
        native_s, reference_s = native_s + t1 - t0, reference_s + time.perf_counter() - t1
        bad = compare(native, reference)
        if bad:
            disagreements += 1
            print(name, bad[0])
        steps += len(native)
        requests += len(stream)
        preemptions += sum(len(r.preempted) for r in native)
        hits += sum(1 for r in native for _, cached in r.admitted if cached)
    print(f"{len(cases)} streams ({len(cases) - len(SCENARIOS)} random, {len(SCENARIOS)} shipped scenarios), "
          f"{requests} requests, {steps} steps compared, {preemptions} preemptions, {hits} admissions "
          f"with prefix-cache hits; streams that disagree: {disagreements}")
    print(f"kvsim {native_s:.1f} s, vLLM's scheduler {reference_s:.1f} s "
          f"({reference_s / native_s:.1f}x), {time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
