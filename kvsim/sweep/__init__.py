"""Many runs: parameter sweeps on a process pool or a Ray cluster, and capacity search.

Exports: grid.load_sweep (sweep files), backends.LocalPool and RayCluster, store.Store (a sweep's folder), capacity.
"""
