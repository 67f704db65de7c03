"""What a run's records mean: summary tables, rate sweeps, latency targets and verdicts;
and what a trace's prompts mean for a prefix cache of any size (cache curves).

Exports: metrics.summarize, step_table, request_table; rates; slo.misses; verdict.sentence;
unmodelled.notes (settings the step-cost model leaves without effect); block_refs.block_references
and cache_curve.cache_curve (`kvsim cache-curve`).
"""
