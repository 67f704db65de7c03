"""Shared test set-up: every `kvsim run` in the suite checks invariants after each step."""
import os

os.environ.setdefault("KVSIM_CHECK_INVARIANTS", "1")
