"""Workloads whose prompts share content, for prefix caching to find.

A request's identity is its content runs (see SeqShape): shared `segments` at the start
of the prompt, then its own tail (the rest of the prompt and its output). Content ids
0..n-1 are the n requests' tails (for conversations, numbered in draw order before
the turns are sorted by arrival); shared content gets ids from n upwards.

- prefix: G shared prefixes of N tokens (system prompts, few-shot examples); each
  request starts with one, chosen uniformly or by a Zipf law, and prompt_tokens gives
  the unique rest.
- rag: one shared system prompt, then k documents retrieved from a corpus with skewed
  (Zipf) or uniform popularity, in retrieval order, then the unique question.
- conversation: multi-turn chats. Each turn's prompt is the previous turn's whole
  context (its prompt and its answer) plus new tokens from prompt_tokens. The arrival
  process starts conversations; turn k arrives think_time_s after turn k-1 arrived
  (open loop: every policy sees the same times, so a turn may arrive before the
  previous answer is finished, and then finds less of it cached). A conversation ends
  early when the next turn would exceed max_model_len.
"""

from __future__ import annotations

import numpy as np

from kvsim.config.scenario import RAG, Conversation, PrefixGroups


def shared_tokens(sharing) -> int:
    """Shared tokens every prompt starts with (0 for conversations: they grow)."""
    if isinstance(sharing, PrefixGroups):
        return sharing.tokens
    if isinstance(sharing, RAG):
        return sharing.system_tokens + sharing.docs_per_request * sharing.doc_tokens
    return 0


def popularity(size: int, law: str, s: float) -> np.ndarray:
    """Choice probabilities over `size` items: uniform, or Zipf with exponent s."""
    weights = np.ones(size) if law == "uniform" else 1.0 / np.arange(1, size + 1) ** s
    return weights / weights.sum()


def shared_segments(sharing, n: int, rng: np.random.Generator) -> list[tuple[tuple[int, int], ...]]:
    """The shared runs each of n requests starts with (prefix groups or RAG)."""
    if isinstance(sharing, PrefixGroups):
        p = popularity(sharing.groups, sharing.popularity, sharing.zipf_s)
        groups = rng.choice(sharing.groups, size=n, p=p)
        return [((n + int(g), sharing.tokens),) for g in groups]
    p = popularity(sharing.corpus_docs, sharing.popularity, sharing.zipf_s)
    system = ((n, sharing.system_tokens),) if sharing.system_tokens else ()
    cdf = cumulative(p)
    out = []
    for _ in range(n):
        docs = draw_distinct(rng, p, cdf, sharing.docs_per_request)
        out.append(system + tuple((n + 1 + d, sharing.doc_tokens) for d in docs))
    return out


def cumulative(p: np.ndarray) -> np.ndarray:
    """p's cumulative sums scaled to end at exactly 1."""
    cdf = np.cumsum(p)
    cdf /= cdf[-1]
    return cdf


def draw_distinct(rng: np.random.Generator, p: np.ndarray, cdf: np.ndarray, k: int) -> list[int]:
    """k distinct items drawn by probabilities p (cdf = cumulative(p)), in draw order, as
    numpy's `rng.choice(len(p), k, replace=False, p=p)` draws them: the same uniform
    numbers and the same items (tests/test_workload.py compares the two), in a few
    microseconds rather than about 40 (the main job draws documents for 2,000 requests
    before any policy runs), and no longer tied to how a numpy release implements choice.

    Each round draws one uniform number per item still missing and maps it through the
    cdf of the items not yet drawn; repeats within a round are dropped and drawn again in
    the next round (Generator.choice in numpy/random/_generator.pyx, numpy's main branch)."""
    drawn = list(dict.fromkeys(cdf.searchsorted(rng.random(k), side="right").tolist()))
    while len(drawn) < k:
        x = rng.random(k - len(drawn))
        left = p.copy()
        left[drawn] = 0
        drawn += dict.fromkeys(cumulative(left).searchsorted(x, side="right").tolist())
    return drawn


def conversations(
    conv: Conversation, starts: np.ndarray, new_tokens: np.ndarray, output_tokens: np.ndarray, max_model_len: int
):
    """Turns as (arrival_s, prompt, output, segments, tail_id), sorted by arrival.

    Draws new_tokens[i], output_tokens[i] in order; a new conversation begins at the
    next start time when one has had `turns` turns or cannot grow further.
    """
    turns, i, c = [], 0, 0
    n = len(new_tokens)
    while i < n:
        segments, t0 = (), float(starts[c])
        for k in range(conv.turns):
            if i == n:
                break
            context = sum(length for _, length in segments)
            prompt, output = context + int(new_tokens[i]), int(output_tokens[i])
            if k and prompt + output > max_model_len:
                break
            turns.append((t0 + k * conv.think_time_s, prompt, output, segments, i))
            segments += ((i, int(new_tokens[i]) + output),)  # this turn's tail, answered
            i += 1
        c += 1
    turns.sort(key=lambda t: t[0])  # stable: same-time turns keep their draw order
    return turns
