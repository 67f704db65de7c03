"""What a run's records mean: summary tables, rate sweeps, latency targets and verdicts.

Exports: metrics.summarize, step_table, request_table; rates; slo.misses; verdict.sentence;
unmodelled.notes (settings the step-cost model leaves without effect).
"""
