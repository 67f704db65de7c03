"""Measuring the tensor-parallel all-reduce, for `kvsim calibrate`.

With tp workers each layer all-reduces its N x hidden activations twice (after the
attention output projection and after the MLP). kvsim.cost.model charges each one as a
ring: latency + 2 (tp-1)/tp x N x hidden x 2 B / bus bandwidth. Here tp worker
processes (one GPU each with NCCL, or CPU processes with gloo) time
torch.distributed.all_reduce of N x hidden tensors in the model dtype, back to back
in batches (the median batch's mean is kept); one
least-squares fit over every tp and N gives the latency and the bus bandwidth in the
cost model's terms. Those count 2 bytes per element, so a CPU profile, which reduces
float32, shows half the bandwidth it moved, and predicts the times it measured.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

ACT_BYTES = 2  # the cost model's bytes per activation element
BATCHES = 5  # timed batches of `reps` all-reduces; the median is kept


def measure(
    torch, device: str, tps: list[int], tokens: list[int], hidden: int, warmup: int, reps: int, log=print
) -> tuple[dict | None, str]:
    """(the fitted all-reduce with its points, "") or (None, why it was not measured)."""
    workers = torch.cuda.device_count() if device == "cuda" else (os.cpu_count() or 1)
    sizes = [tp for tp in tps if 1 < tp <= workers]
    if not sizes:
        return None, f"one {'GPU' if device == 'cuda' else 'core'}"
    rows = []
    for tp in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                torch.multiprocessing.spawn(_worker, args=(tp, device, tokens, hidden, warmup, reps, tmp), nprocs=tp)
            except torch.multiprocessing.ProcessException as e:
                return None, f"the tp {tp} workers failed: {str(e).splitlines()[0]}"
            rows += json.loads((Path(tmp) / "times.json").read_text())
        log(f"  all-reduce at tp {tp}: done")
    backend = "NCCL" if device == "cuda" else "gloo"
    return {
        **fit(rows, hidden),
        "points": rows,
        "source": f"measured: torch.distributed all_reduce ({backend}) of N x hidden at tp "
        f"{', '.join(map(str, sizes))}",
    }, ""


def fit(rows: list[dict], hidden: int) -> dict:
    """Latency and bus bandwidth of t = latency + 2 (tp-1)/tp x N x hidden x 2 B / bus."""
    x = np.array([2 * (r["tp"] - 1) / r["tp"] * r["num_tokens"] * hidden * ACT_BYTES for r in rows])
    t = np.array([r["time_s"] for r in rows])
    lat, per_byte = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), t, rcond=None)[0]
    if lat < 0:  # no fixed cost visible: a line through the origin
        lat, per_byte = 0.0, float(x @ t / (x @ x))
    per_byte = max(per_byte, 1e-15)  # flat times (tiny messages only): bandwidth unbounded
    pred = lat + per_byte * x
    return {
        "latency_s": float(lat),
        "bus_gb_s": float(1 / per_byte / 1e9),
        "fit_mape": float(np.mean(np.abs(pred - t) / t)),
    }


def _worker(rank: int, tp: int, device: str, tokens: list[int], hidden: int, warmup: int, reps: int, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # tp processes share the cores
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=tp)
    rows = []
    try:
        for n in tokens:
            x = torch.randn(
                n, hidden, device=f"cuda:{rank}" if cuda else "cpu", dtype=torch.bfloat16 if cuda else torch.float32
            )
            for _ in range(warmup):
                dist.all_reduce(x)
            times = []
            for _ in range(BATCHES):  # back to back, as nccl-tests time them: no wake-up jitter
                dist.barrier()
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(reps):
                    dist.all_reduce(x)
                if cuda:
                    torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) / reps)
            rows.append({"tp": tp, "num_tokens": n, "time_s": float(np.median(times))})
    finally:
        dist.destroy_process_group()
    if rank == 0:
        (Path(tmp) / "times.json").write_text(json.dumps(rows))
