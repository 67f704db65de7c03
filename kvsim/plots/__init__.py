"""Figures (matplotlib, bare Agg Figures) and the self-contained HTML report of `kvsim compare`.

Exports: run_figures.write_plots; curves; sweep_figures; style and colours (how a policy looks); compare.build_report; html;
cache_curve.cache_curve_figure.
"""
