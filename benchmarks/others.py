"""The other simulators bench_speed.py compares kvsim with: how each is run on the same
workload, or the figure recorded where it cannot run here.

BLIS (github.com/inference-sim/inference-sim, Go) runs where its binary is built
(benchmarks/build_blis.sh; `--blis PATH`), with its `roofline` latency model, on the
same requests as kvsim's `vidur_*` workloads: Llama-2-7B on an A100 80GB, 512 prompt and
128 output tokens, Poisson arrivals at 10 req/s, one instance. It runs twice: as shipped,
and with its routing snapshot off (`--snapshot-refresh-interval 0 --cache-signal-delay
0`: the router reads each instance's metrics and cached blocks live rather than from a
copy refreshed every 50 ms of simulated time, which as shipped is an event every 50 ms;
with one instance the router has one choice either way, so the simulated work is the
same).

Vidur 0.0.26 (`pip install vidur==0.0.26`) cannot run here: its execution-time
predictor (vidur/execution_time_predictor/sklearn_execution_time_predictor.py,
`_get_input_files`) fetches the compute and network profiling datasets named by
`model_profiling_dataset` and `network_profiling_dataset` with huggingface_hub's
`snapshot_download` into `cache_dir`. With HF_HUB_OFFLINE=1 that call answers from a
local copy laid out as the hub's cache
(`<cache_dir>/profiling_data/compute/datasets--ORG--NAME/snapshots/REV/` holding
`config.json` with `model` and `device_sku`, `mlp.csv.xz` and `attention.csv.xz`, and
`refs/main` naming REV; the network dataset alike with `config.json`'s `sku`,
`all_reduce.csv.xz` and `send_recv.csv.xz`). The per-operator MLP timings for
Llama-2-7B on A100 are at hand, but not its attention timings nor the network profiles,
so that copy cannot be made and the figure used is the one recorded below.
"""

from __future__ import annotations

import json
from pathlib import Path

# Figures measured by hand on this project's 2-core machine (medians of 3, alternated
# with kvsim), for the simulators or workloads that cannot run here.
RECORDED = [
    {"tool": "Vidur 0.0.26 (vLLM scheduler)", "workload": "vidur_10k", "wall_s": 20.6, "peak_rss_mb": 403},
    {
        "tool": "BLIS f90a1e3 (roofline), as shipped",
        "workload": "sharegpt_1m",
        "wall_s": 689.0,
        "peak_rss_mb": 18 * 1024,
        "note": "its run overloaded: 835k preemptions",
    },
]
VIDUR_10K_S = 20.6

BLIS_WORKLOAD = [
    "--model",
    "meta-llama/llama-2-7b-hf",
    "--hardware",
    "A100-80",
    "--tp",
    "1",
    "--latency-model",
    "roofline",
    "--rate",
    "10",
    "--seed",
    "42",
    "--prompt-tokens",
    "512",
    "--prompt-tokens-stdev",
    "0",
    "--prompt-tokens-min",
    "512",
    "--prompt-tokens-max",
    "512",
    "--output-tokens",
    "128",
    "--output-tokens-stdev",
    "0",
    "--output-tokens-min",
    "128",
    "--output-tokens-max",
    "128",
]
BLIS_VARIANTS = {"BLIS": [], "BLIS, snapshot off": ["--snapshot-refresh-interval", "0", "--cache-signal-delay", "0"]}


def blis_command(source: Path, requests: int, variant: str) -> list[str]:
    """BLIS reads defaults.yaml, hardware_config.json and model_configs/ from its source
    folder, where build_blis.sh leaves the binary: run it there."""
    return [str(source / "blis"), "run", *BLIS_WORKLOAD, "--num-requests", str(requests), *BLIS_VARIANTS[variant]]


def blis_work(stdout: str) -> dict:
    """The simulated work BLIS reports on stdout: requests done and simulated seconds."""
    text = stdout.split("=== Simulation Metrics ===", 1)[1]
    metrics = json.JSONDecoder().raw_decode(text.strip())[0]
    return {
        "requests": int(metrics["completed_requests"]),
        "steps": None,
        "makespan_s": float(metrics["vllm_estimated_duration_s"]),
        "mean_batch": None,
    }
