"""kvsim's radix tree against SGLang 0.5.23's own RadixCache, operation by operation
(kvsim.engines.sglang_reference): 100 random runs of 300 operations for pages of 1 and
of 4 tokens, inserts, lookups, locks, unlocks and evictions; they must agree exactly.
Skips where SGLang 0.5.23 does not import. It runs in a child process, since importing
SGLang here stands an empty module in for torchvision."""

from helpers import sglang_child

CHECK = """
from kvsim.engines.sglang_reference import differential
found = [f for page in (1, 4) for seed in range(100) for f in differential(seed, page)]
print("RUNS", 200, "DISAGREEMENTS", len(found))
for f in found[:5]:
    print(f)
"""


def test_kvsim_radix_tree_agrees_with_sglangs_step_by_step():
    lines = sglang_child(CHECK, timeout=900)
    report = next(line for line in lines if line.startswith("RUNS"))
    assert report == "RUNS 200 DISAGREEMENTS 0", "\n".join(lines[-10:])
