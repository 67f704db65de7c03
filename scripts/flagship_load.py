"""Which arrival rate the flagship and the tutorial run at: a scenario at several rates,
and at each the policies that meet its slo: block under the step costs kvsim ships.

The rate is chosen where the policies part: the highest rate at which some policy still
meets every target while others do not (so the verdict says something) and the server
keeps up with the arrivals under every policy (their throughputs within 2%: arrivals,
not the server, set them), below the rate at which none does (the overloaded variant,
rag_8k_overload, shows that regime). Rerun this whenever the default step costs change,
and move the rate in the scenario if the answer moved:

    python scripts/flagship_load.py [--rates 1,2,3,4,5,6] [--scenario scenarios/rag_8k.yaml]
    python scripts/flagship_load.py --scenario scenarios/tutorial_vllm_serve.yaml --rates 3,3.5,4,4.5,5
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvsim.analysis.rates import parse_rates, with_rate
from kvsim.analysis.slo import misses
from kvsim.analysis.results import run_scenario
from kvsim.config.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[1]
KEEPS_UP = 0.98  # the lowest throughput at least this share of the highest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default=str(ROOT / "scenarios" / "rag_8k.yaml"))
    ap.add_argument("--rates", default="1,2,3,4,5,6,8,10,12,16")
    args = ap.parse_args()
    scn, base = load_scenario(args.scenario)
    targets = scn.slo.targets() if scn.slo else {}
    if not targets:
        raise SystemExit(f"{args.scenario} has no slo: block")
    print(f"{scn.name}: targets {targets}; step costs {scn.cost_model}")
    parting = None
    for rate in parse_rates(args.rates):
        summary = run_scenario(with_rate(scn, rate, args.scenario), base, args.scenario, workers=1).summary
        rows = summary.to_dict(orient="records")
        met = [r["policy"] for r in rows if not misses(r, targets)]
        tput = summary["throughput_tok_s"]
        keeps_up = bool(tput.min() >= KEEPS_UP * tput.max())
        print(
            f"{rate:g} req/s: {len(met)}/{len(rows)} meet every target: {', '.join(met) or '-'}"
            f"{'' if keeps_up else ' (the server falls behind the arrivals under some policy)'}"
        )
        for r in rows:
            print(
                f"    {r['policy']:<20} TTFT p99 {r['ttft_p99_s']:8.3f} s  TPOT p50 {r['tpot_p50_s']:.4f} s  "
                f"{r['throughput_tok_s']:7.0f} tok/s"
            )
        if met and len(met) < len(rows) and keeps_up:
            parting = rate
        if not met:
            break
    print(
        "highest swept rate at which the policies part and the server keeps up: "
        f"{parting if parting is not None else 'none'} req/s"
    )


if __name__ == "__main__":
    main()
