"""kvsim's radix pool against SGLang 0.5.23's own token-to-KV pool allocators and radix
cache, request by request (kvsim.engines.sglang_pool_reference): 100 random runs of 200
operations for pages of 1 token (TokenToKVPoolAllocator) and of 4 (PagedTokenToKVPoolAllocator):
admissions with their prefix lookups, checkpoints after prefill, decodes, finishes,
retractions and evictions; free, evictable and cached slots and every request's slots must
agree after each. Skips where SGLang 0.5.23 does not import; runs in a child process, as
the radix differential does."""

from helpers import sglang_child

CHECK = """
from kvsim.engines.sglang_pool_reference import run_all
counts, found = run_all()
print("KINDS", " ".join(f"{k}={v}" for k, v in counts.items() if k != "runs"))
print("RUNS", counts["runs"], "DISAGREEMENTS", len(found))
for f in found[:5]:
    print(f)
"""


def test_kvsim_radix_pool_agrees_with_sglangs_allocators_step_by_step():
    lines = sglang_child(CHECK, timeout=1200)
    report = next(line for line in lines if line.startswith("RUNS"))
    assert report == "RUNS 200 DISAGREEMENTS 0", "\n".join(lines[-10:])
    # the streams press the pool: refusals, retractions and evictions happen in them
    kinds = dict(x.split("=") for x in next(line for line in lines if line.startswith("KINDS")).split()[1:])
    assert all(int(kinds[k]) > 100 for k in ("refused", "retract", "evict", "finish"))
