"""Command-line arguments that name a model or a GPU, shared by every command."""

from __future__ import annotations

import difflib
from pathlib import Path

from kvsim.config.errors import InputError
from kvsim.model.specs import GPU_PRESETS, MODEL_PRESETS, model_from_hf_config


def model_arg(name: str):
    if name in MODEL_PRESETS:
        return MODEL_PRESETS[name]
    if name.endswith(".json") or Path(name).is_file():
        try:
            return model_from_hf_config(name)
        except ValueError as e:
            raise InputError("command line", "--model", str(e)) from None
    close = difflib.get_close_matches(name.lower(), list(MODEL_PRESETS), n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise InputError(
        "command line",
        "--model",
        f"unknown model '{name}'{hint}; choose a preset ({', '.join(MODEL_PRESETS)}) or give a config.json path",
    )


def gpu_arg(name: str):
    if name not in GPU_PRESETS:
        raise InputError("command line", "--gpu", f"unknown GPU '{name}'; choose from: {', '.join(GPU_PRESETS)}")
    return GPU_PRESETS[name]


def override(scn, src: str, seed: int | None, num_requests: int | None, policies):
    """The scenario with the command line's --seed, --num-requests and --policy applied."""
    update = {}
    if seed is not None:
        update["seed"] = seed
    if num_requests is not None:
        update["workload"] = scn.workload.model_copy(update={"num_requests": num_requests})
    if policies:
        known = {p.name: p for p in scn.policies}
        for name in policies:
            if name not in known:
                raise InputError(src, "--policy", f"no policy '{name}'; the scenario has: {', '.join(known)}")
        update["policies"] = [known[n] for n in dict.fromkeys(policies)]
    return scn.model_copy(update=update)
