"""Derive kvsim's workload length presets from the reference traces.

Reads the four CSVs under ``../shared/data/traces`` (relative to the repository root;
pass another folder as the first argument) and writes ``kvsim/data/datasets.json``.
The package ships only what is derived here, never the traces themselves:

* for each length dataset, the marginal quantiles of prompt and output tokens on a
  207-point probability grid (every 0.5% up to 99%, then denser in the upper tail so
  that piecewise-linear sampling keeps the mean within 0.3% even for the heavy-tailed
  Azure code outputs), the Spearman rank correlation between prompt and output (a
  Gaussian copula joins the marginals at sampling time), the row count and the means;
* for the two Azure traces, the arrival statistics over the hour: mean rate
  (1 / mean inter-arrival time, req/s) and the coefficient of variation of the
  inter-arrival times (1 for a Poisson process);
* two presets from published statistics only (no file): ``sharegpt`` and ``alpaca``
  as described in the vLLM paper (Kwon et al., SOSP 2023). The paper gives only the
  means and says both are right-skewed with long tails, so each marginal is a lognormal
  with the published mean and an ASSUMED coefficient of variation (ASSUMED_CV below),
  prompt and output independent; vLLM's benchmark filter is applied at sampling time.

Sources: microsoft/vidur ``data/processed_traces/`` (MIT licence); the splitwise files
are the Azure Public Dataset LLM inference trace 2023 (CC-BY-4.0) as processed there.

Output is deterministic: sorted keys, floats rounded, quantiles as ints.

Usage: python scripts/derive_datasets.py [TRACES_DIR] [OUTPUT_JSON]
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACES = REPO.parent / "shared" / "data" / "traces"
DEFAULT_OUTPUT = REPO / "kvsim" / "data" / "datasets.json"

# 0, 0.005, ..., 0.99, then a denser upper tail: linear interpolation between the
# 99.5% point and the maximum would otherwise overstate heavy-tailed means (by 9% for
# azure-code outputs with a plain 201-point grid).
QUANTILE_PROBS = [round(p, 6) for p in np.linspace(0.0, 0.99, 199)] + [
    0.9925,
    0.995,
    0.9975,
    0.999,
    0.9995,
    0.99975,
    0.9999,
    1.0,
]

VIDUR = "microsoft/vidur data/processed_traces (MIT licence)"
AZURE = (
    "Azure Public Dataset LLM inference trace 2023 (CC-BY-4.0), "
    "as processed in microsoft/vidur data/processed_traces (MIT licence)"
)

# name -> (file, origin, description)
FILE_DATASETS = {
    "sharegpt-multiturn": (
        "sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
        VIDUR,
        "ShareGPT conversations, multi-turn context accumulated into the prompt, Llama-2 tokenizer, total <= 8k tokens",
    ),
    "arxiv-summarization": (
        "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
        VIDUR,
        "arXiv paper summarization: long prompts, short outputs (RAG-like), Llama-2 tokenizer",
    ),
    "azure-conv": ("splitwise_conv.csv", AZURE, "Azure conversation service, one hour of real arrivals"),
    "azure-code": (
        "splitwise_code.csv",
        AZURE,
        "Azure code-completion service, one hour of real arrivals: long prompts, very short outputs",
    ),
}

# The vLLM paper publishes only means; these CVs are OUR ASSUMPTION (a lognormal with
# CV 1 has sigma = 0.83: right-skewed with a long tail, as the paper describes).
ASSUMED_CV = 1.0
VLLM_PAPER = "Kwon et al., Efficient Memory Management for Large Language Model Serving with PagedAttention, SOSP 2023"
# vLLM benchmark scripts: drop prompt or output < 4, prompt > 1024, prompt+output > 2048.
VLLM_FILTER = {"min_tokens": 4, "max_prompt": 1024, "max_total": 2048}
PUBLISHED = {"sharegpt": (161.31, 337.99), "alpaca": (19.31, 58.45)}


def length_stats(frame: pd.DataFrame) -> dict:
    """Quantiles, means and rank correlation of one trace's prompt/output lengths."""
    prompt = frame["num_prefill_tokens"].to_numpy(dtype=np.int64)
    output = frame["num_decode_tokens"].to_numpy(dtype=np.int64)
    spearman = pd.Series(prompt).rank().corr(pd.Series(output).rank())
    return {
        "kind": "quantiles",
        "count": int(len(frame)),
        "prompt_mean": round(float(prompt.mean()), 3),
        "output_mean": round(float(output.mean()), 3),
        "spearman": round(float(spearman), 4),
        "quantile_probs": QUANTILE_PROBS,
        "prompt_quantiles": np.rint(np.quantile(prompt, QUANTILE_PROBS)).astype(int).tolist(),
        "output_quantiles": np.rint(np.quantile(output, QUANTILE_PROBS)).astype(int).tolist(),
    }


def arrival_stats(arrived_at: np.ndarray) -> dict:
    """Mean rate and inter-arrival CV of one trace's arrival times (seconds)."""
    gaps = np.diff(np.sort(arrived_at))
    return {
        "duration_s": round(float(arrived_at.max() - arrived_at.min()), 3),
        "rate_per_s": round(float(1.0 / gaps.mean()), 4),
        "interarrival_cv": round(float(gaps.std() / gaps.mean()), 4),
    }


def published_preset(name: str) -> dict:
    prompt_mean, output_mean = PUBLISHED[name]
    return {
        "kind": "lognormal",
        "prompt": {"mean": prompt_mean, "cv": ASSUMED_CV},
        "output": {"mean": output_mean, "cv": ASSUMED_CV},
        "filter": VLLM_FILTER,
        "source": f"{name} means from {VLLM_PAPER}; filter from vLLM's benchmark scripts",
        "note": (
            f"The paper gives only means (right-skewed, long tails). Each marginal "
            f"is a lognormal with that mean and an ASSUMED coefficient of variation "
            f"of {ASSUMED_CV}; prompt and output independent. Draws are rounded to "
            f"whole tokens and redrawn when the vLLM benchmark filter drops them, "
            f"so the sampled means differ from the published ones."
        ),
    }


def derive(traces: Path) -> dict:
    datasets = {}
    for name, (filename, origin, description) in FILE_DATASETS.items():
        frame = pd.read_csv(traces / filename)
        entry = length_stats(frame)
        entry["source"] = f"{filename} from {origin}"
        entry["note"] = description
        if "arrived_at" in frame:
            entry["arrival"] = arrival_stats(frame["arrived_at"].to_numpy(dtype=float))
        datasets[name] = entry
    for name in PUBLISHED:
        datasets[name] = published_preset(name)
    return {"format": 1, "generated_by": "scripts/derive_datasets.py", "datasets": datasets}


def dumps(document: dict) -> str:
    """Indented JSON with sorted keys, but each list of numbers on one line."""
    text = json.dumps(document, indent=1, sort_keys=True)
    return re.sub(r"\[[-0-9.e,\s]*\]", lambda m: json.dumps(json.loads(m.group(0))), text) + "\n"


def main(argv: list[str]) -> int:
    traces = Path(argv[1]) if len(argv) > 1 else DEFAULT_TRACES
    output = Path(argv[2]) if len(argv) > 2 else DEFAULT_OUTPUT
    if not traces.is_dir():
        print(f"{traces}: no such folder (pass the traces folder as the first argument)", file=sys.stderr)
        return 2
    output.write_text(dumps(derive(traces)), encoding="utf-8")
    print(f"wrote {output} ({output.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
