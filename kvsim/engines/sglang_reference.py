"""SGLang's own radix tree (SGLang 0.5.23, python/sglang/srt/mem_cache/radix_cache.py,
class RadixCache), driven beside kvsim's (kvsim.kvcache.radix_tree) operation by
operation.

SGLang's `RadixCache.create_simulated` builds the tree without memory pools ("for
simulation purpose"); a stand-in pool takes the slots it frees on eviction. Each
operation is given to both trees: insert a sequence's first tokens, look one up (which
refreshes the path's recency and splits the edge it ends inside), lock or unlock the
path a lookup ended on, evict at least n slots. After each, `compare` checks that both
answered alike (tokens the tree had, tokens matched, slots evicted) and hold the same
tree: slots, evictable slots, and every root-to-leaf token sequence.

Importing it on a CPU-only machine: `sglang.srt.mem_cache` imports sglang's model
configs, which import torchvision for image models; no torchvision release works beside
PyTorch's CPU-only wheel. `load_sglang` lets an empty module stand in for torchvision
(nothing of it is used by the tree) after telling transformers it is absent. It also
needs sglang's pure-Python requirements (`pip install --no-deps sglang==0.5.23`, then
what its imports ask for: dill, sentencepiece, compressed-tensors, gguf, orjson, loguru,
and the rest of vLLM's extra).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType, SimpleNamespace

SGLANG_VERSION = "0.5.23"
INSTALL = f"pip install --no-deps sglang=={SGLANG_VERSION} dill sentencepiece compressed-tensors gguf orjson loguru"


class SGLangMissing(ImportError):
    """SGLang (the pinned release) is not importable here."""


class _EmptyModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty packages for the named top-level modules (and their submodules)."""

    def __init__(self, *roots: str):
        self.roots = set(roots)

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Anything(spec.name)
        module.__path__, module.__spec__ = [], spec
        return module

    def exec_module(self, module):
        pass


class _Anything(ModuleType):
    """A module whose every attribute is another (names imported from it resolve)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        return _Anything(f"{self.__name__}()")


def load_sglang():
    """SGLang's RadixCache and its parameter types; SGLangMissing where it cannot import."""
    try:
        import sglang
    except ImportError as e:
        raise SGLangMissing(
            f"the SGLang differentials need SGLang {SGLANG_VERSION} ({e}); install it with: {INSTALL}"
        ) from None
    if sglang.__version__ != SGLANG_VERSION:
        raise SGLangMissing(f"pinned to SGLang {SGLANG_VERSION}, found {sglang.__version__}")
    try:
        import torchvision  # noqa: F401  (a working one: nothing to stand in for)
    except Exception:
        import transformers.utils.import_utils as hf_imports

        hf_imports._torchvision_available = False
        sys.modules.pop("torchvision", None)
        if not any(isinstance(f, _EmptyModules) for f in sys.meta_path):
            sys.meta_path.insert(0, _EmptyModules("torchvision"))
    try:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    except ImportError as e:
        raise SGLangMissing(
            f"SGLang {SGLANG_VERSION}'s radix cache does not import ({e}); install its requirements: {INSTALL}"
        ) from None
    return SimpleNamespace(
        RadixCache=RadixCache,
        RadixKey=RadixKey,
        EvictParams=EvictParams,
        InsertParams=InsertParams,
        MatchPrefixParams=MatchPrefixParams,
    )


class _Pool:
    """The token-to-KV pool's part the tree calls: eviction gives slots back."""

    device = "cpu"

    def __init__(self):
        self.freed = 0

    def free_segment(self, value, start_pos: int = 0):
        self.freed += len(value) - start_pos


class SGLangTree:
    """SGLang's RadixCache over token ids, with kvsim's tree's operations."""

    def __init__(self, page_size: int, sg=None):
        self.sg = sg or load_sglang()
        self.cache = self.sg.RadixCache.create_simulated(mock_allocator=_Pool(), page_size=page_size)

    def _key(self, ids: list[int]):
        from array import array

        return self.sg.RadixKey(array("q", ids))

    def insert(self, ids: list[int]) -> int:
        """Tokens of `ids` (whole pages) the tree had already."""
        return self.cache.insert(self.sg.InsertParams(key=self._key(ids))).prefix_len

    def lookup(self, ids: list[int]):
        """(tokens matched, the node the match ends on)."""
        result = self.cache.match_prefix(self.sg.MatchPrefixParams(key=self._key(ids)))
        return result.device_prefix_len, result.last_device_node

    def lock(self, node, delta: int) -> None:
        (self.cache.inc_lock_ref if delta > 0 else self.cache.dec_lock_ref)(node)

    def evict(self, amount: int) -> int:
        return self.cache.evict(self.sg.EvictParams(num_tokens=amount)).num_tokens_evicted

    @property
    def size(self) -> int:
        return self.cache.total_size()

    @property
    def evictable(self) -> int:
        return self.cache.evictable_size()

    def sequences(self) -> list[tuple[int, ...]]:
        """Every root-to-leaf token sequence, sorted."""
        out, stack = [], [(self.cache.root_node, ())]
        while stack:
            node, prefix = stack.pop()
            if node.children:
                stack += [(c, prefix + tuple(c.key.token_ids)) for c in node.children.values()]
            elif node is not self.cache.root_node:
                out.append(prefix)
        return sorted(out)


# --- the differential: random operations on both trees -----------------------------------
def ids_of(runs) -> list[int]:
    """Token ids for content runs: (content, offset) packed in one int."""
    return [content * 1_000_003 + offset + k for content, offset, length in runs for k in range(length)]


def kvsim_sequences(tree) -> list[tuple[int, ...]]:
    out = []
    for node, _ in tree.all_nodes():
        if not node.children:
            runs, at = (), node
            while at is not tree.root:
                runs, at = at.runs + runs, at.parent
            out.append(tuple(ids_of(runs)))
    return sorted(out)


def differential(seed: int, page_size: int, ops: int = 300) -> list[str]:
    """Run `ops` random operations on kvsim's RadixTree and SGLang's RadixCache; the
    disagreements found (empty where they agree throughout)."""
    import numpy as np
    from kvsim.kvcache import SeqShape
    from kvsim.kvcache.radix_tree import RadixTree

    rng = np.random.default_rng(seed)
    ours, theirs = RadixTree(page_size), SGLangTree(page_size)
    shapes = [
        SeqShape(
            int(rng.integers(4, 40)),
            0,
            tuple((int(rng.integers(0, 4)), int(rng.integers(1, 12))) for _ in range(int(rng.integers(0, 3)))),
            tail_id=100 + i,
        )
        for i in range(12)
    ]
    ends, locks, found = [], [], []
    for step in range(ops):
        shape = shapes[int(rng.integers(len(shapes)))]
        runs = shape.runs(0, int(rng.integers(1, shape.prompt_tokens + 1)))
        op = rng.choice(["insert", "lookup", "lock", "unlock", "evict"], p=[0.35, 0.3, 0.12, 0.1, 0.13])
        if op == "insert":
            a, b = ours.insert(runs)[1], theirs.insert(ids_of(ours.whole_pages(runs)))
        elif op == "lookup":
            match = ours.walk(runs)
            node = ours.touch(match)
            b, end = theirs.lookup(ids_of(runs))
            a = match.matched
            ends.append((node, end))
        elif op == "lock" and ends:
            node, end = ends[int(rng.integers(len(ends)))]
            ours.lock(node, +1)
            theirs.lock(end, +1)
            locks.append((node, end))
            a = b = 0
        elif op == "unlock" and locks:
            node, end = locks.pop(int(rng.integers(len(locks))))
            ours.lock(node, -1)
            theirs.lock(end, -1)
            a = b = 0
        elif op == "evict":
            amount = int(rng.integers(1, 30))
            a, b = ours.evict(amount), theirs.evict(amount)
            ends = [(n, e) for n, e in ends if any(n is x for x, _ in locks)]  # evicted ends go
        else:
            continue
        if a != b:
            found.append(f"seed {seed} step {step} {op}: kvsim {a}, SGLang {b}")
        if (ours.size, ours.evictable) != (theirs.size, theirs.evictable):
            found.append(
                f"seed {seed} step {step} {op}: kvsim holds {ours.size} ({ours.evictable} "
                f"evictable), SGLang {theirs.size} ({theirs.evictable})"
            )
        elif kvsim_sequences(ours) != theirs.sequences():
            found.append(f"seed {seed} step {step} {op}: the cached sequences differ")
        if found:
            break
    return found
