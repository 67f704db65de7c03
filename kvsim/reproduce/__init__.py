"""`kvsim reproduce`: published claims about KV-cache memory, each measured by running kvsim.

Exports: claims.reproduce (runs them); checks.CHECKS (one function per claim; Mooncake's in mooncake.py).
"""
