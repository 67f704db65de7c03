"""What a run's records mean to a reader: summary tables and plots.

Exports: metrics.summarize, step_table, request_table; plots.write_plots (imports matplotlib).
"""
