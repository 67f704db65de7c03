"""Which of a scenario's policy settings leave the step time unchanged, as the step-cost
model prices it.

A policy's block size, KV dtype and scale granularity change what fits in the KV pool;
whether they also change how long a step of the same batch takes depends on the cost
model (a profile may time attention per block size or per dtype; the roofline reads
fewer bytes of a quantized cache; some fits take neither). This asks the model itself:
for every policy, and every other value of a setting that some policy of the scenario
uses, it prices the same few steps (a long prefill, a decode of many sequences, a step
with both) with only that setting changed. A setting none of whose changes moves any of
those times has no modelled effect on step time, and the figures say so: differences
between such policies come from memory alone (batch size, queueing, preemption).

A quantized KV cache (fp8, int8, int4) is priced by the fewer bytes attention reads; what
dequantizing it costs is priced only where the step costs were measured with that dtype
(a profile's per-dtype decode fit). Elsewhere, for a policy that uses one, the notes say
that the dequantization is not modelled.
"""

from __future__ import annotations

from pathlib import Path

from kvsim.cost.model import StepBatch, make_cost_model
from kvsim.model.specs import KVSpec, resolve_kv_dtype

SETTINGS = {"block_size": "block size", "kv_cache_dtype": "KV dtype", "kv_scale": "KV scale granularity"}
PROBES = (
    StepBatch.build([(2048, 0)], []),  # a long prefill
    StepBatch.build([], [2000] * 64),  # 64 sequences decoding
    StepBatch.build([(512, 1024)], [3000] * 16 + [500] * 16),
)  # a chunk among decodes


SIXTEEN_BIT = ("fp32", "fp16", "bf16")


def cost_for(scn, policy, base_dir: Path):
    """The scenario's cost model under `policy`'s KV layout and block size."""
    model, gpu = scn.model_spec(base_dir), scn.gpu_spec()
    kv = KVSpec(model, resolve_kv_dtype(policy.kv_cache_dtype, model), policy.kv_scale, policy.kv_scale_group_size)
    _, options = policy.allocator_kind(scn.engine_name)
    settings = scn.engine_settings()
    cost = make_cost_model(
        scn.cost_model,
        model,
        gpu,
        kv,
        scn.tensor_parallel_size,
        block_size=options.get("block_size"),
        base_dir=base_dir,
        engine=settings.engine,
        limits=(settings.max_num_seqs, settings.max_num_batched_tokens),
    )
    return cost, kv.kv_cache_dtype


def step_times(scn, policy, base_dir: Path) -> tuple[float, ...]:
    """The probe steps' seconds under `policy`'s KV layout and block size."""
    cost, _ = cost_for(scn, policy, base_dir)
    return tuple(cost.step_time(batch) for batch in PROBES)


def unpriced_dequantization(scn, base_dir: Path) -> list[str]:
    """The quantized KV dtypes the scenario's policies use whose dequantization the cost
    model does not price (it has no timing measured with that dtype)."""
    return _unpriced([(scn, p) for p in scn.policies], base_dir)


def _unpriced(runs, base_dir: Path) -> list[str]:
    out = []
    for scn, policy in runs:
        cost, dtype = cost_for(scn, policy, base_dir)
        if dtype not in SIXTEEN_BIT and dtype.split("_")[0] not in cost.measured_kv_dtypes and dtype not in out:
            out.append(dtype)
    return out


def unmodelled_settings(scn, base_dir: Path) -> dict[str, list]:
    """{setting: the values its policies use} for each setting that differs between the
    scenario's policies yet changes no probe step's time."""
    return _unmodelled([(scn, p) for p in scn.policies], base_dir)


def _unmodelled(runs, base_dir: Path) -> dict[str, list]:
    """As unmodelled_settings, over (scenario, policy) pairs that may come from different
    scenarios (a sweep's points): each policy is priced in its own scenario, with every
    value of the setting that some pair uses."""
    out = {}
    for field in SETTINGS:
        having = [(scn, p) for scn, p in runs if field in type(p).model_fields]
        values = list(dict.fromkeys(getattr(p, field) for _, p in having))
        if len(values) < 2:
            continue
        moved = False
        for scn, policy in having:
            base = step_times(scn, policy, base_dir)
            for value in values:
                if value != getattr(policy, field):
                    other = step_times(scn, policy.model_copy(update={field: value}), base_dir)
                    if any(abs(a - b) > 1e-9 * max(abs(a), abs(b)) for a, b in zip(base, other)):
                        moved = True
                        break
            if moved:
                break
        if not moved:
            out[field] = values
    return out


def notes(scn, base_dir: Path) -> list[str]:
    """One sentence per setting with no modelled effect on step time, and one naming the
    quantized KV dtypes whose dequantization is not priced."""
    return _notes([(scn, p) for p in scn.policies], base_dir)


def sweep_notes(scenarios, base_dir: Path) -> list[str]:
    """The notes for a sweep's points together: a setting the grid varies from point to
    point (block size 16 at one, 32 at another) is judged across the points' policies,
    each priced in its own point's scenario (model, GPU, step costs)."""
    runs, seen = [], set()
    for scn in scenarios:
        for policy in scn.policies:
            key = (scn.model_dump_json(exclude={"workload", "policies", "seed", "name"}), policy.model_dump_json())
            if key not in seen:  # points that differ only in load price the same steps
                seen.add(key)
                runs.append((scn, policy))
    return _notes(runs, base_dir)


def _notes(runs, base_dir: Path) -> list[str]:
    out = [
        f"{SETTINGS[field]} ({', '.join(map(str, values))}): no modelled effect on step time; "
        "these policies differ through memory alone"
        for field, values in _unmodelled(runs, base_dir).items()
    ]
    dtypes = _unpriced(runs, base_dir)
    if dtypes:
        out.append(
            f"KV dtype {', '.join(dtypes)}: attention reads its fewer bytes; dequantizing it "
            "is not modelled (no step time measured with that dtype)"
        )
    return out
