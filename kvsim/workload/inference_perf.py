"""Requests as inference-perf's data generators make them (kvsim.config.inference_perf
says which release and what the config's fields become).

shared_prefix (datagen/shared_prefix_datagen.py): num_groups x num_prompts_per_group
prompts are made once: for each group a system prompt of system_prompt_len random
tokens, then for each of its prompts a question of question_len random tokens; the
prompt is the system prompt, a space, the question. The list is shuffled once
(`random.shuffle`), and the n-th request of every stage (n counted from 0 in each
stage: loadgen/load_generator.py `run_stage` numbers them) sends prompt n mod the
number of prompts, asking for output_len tokens. So every prompt recurs, identical,
every num_groups x num_prompts_per_group requests, and stages replay the same order. In
kvsim's token identity (kvsim.kvcache.SeqShape) a prompt is two shared runs: its
group's system prompt and its own question; the output is the request's own.

random (datagen/random_datagen.py, utils/distribution.py): total_count input lengths
and, independently, total_count output lengths are drawn once, each as a normal draw
clipped to [min, max] and rounded; total_count defaults to the largest stage's count
plus one (main.py). The n-th request of every stage takes the n-th lengths, its prompt
fresh random tokens (shared with nothing). A stage longer than total_count makes
inference-perf fail with an IndexError; kvsim refuses it.

Both: a request whose max_tokens is 0 is sent with the client's default of 30
(apis/completion.py to_payload; openai_client.py max_completion_tokens).

Prompt lengths: kvsim counts a prompt as the config's lengths (system_prompt_len +
question_len, or the drawn input length). The server tokenizes the prompt's text
again, and its count (the runs' prompt_len, which the client's same tokenizer counts)
is larger: one BOS token, plus about 4-5% more from re-encoding text decoded from
random token ids (Llama-2's tokenizer: 591.6 tokens on average for 100 + 466, 1082 for
100 + 934). That is not a chat template: the completions API applies none.
"""

from __future__ import annotations

import numpy as np

from kvsim.config.errors import InputError

DEFAULT_MAX_TOKENS = 30  # openAIModelServerClient.max_completion_tokens, used where max_tokens is 0


def clipped_normal(dist, rng: np.random.Generator) -> np.ndarray:
    """generate_distribution: total_count normal draws, clipped to [min, max], rounded."""
    x = np.clip(rng.normal(dist.mean, dist.std_dev, dist.total_count), dist.min, dist.max)
    return np.clip(np.round(x).astype(np.int64), dist.min, dist.max)


def inference_perf_requests(
    ip, stage: np.ndarray, largest_stage: int, first_id: int, rng: np.random.Generator, src: str = "scenario"
):
    """(prompt_tokens, output_tokens, segments) of requests whose stages are `stage` (in
    stream order, each stage's requests together); largest_stage: the most requests a
    stage of the whole plan sends. Content ids for shared runs start at first_id (the
    requests' own ids are below it)."""
    n = len(stage)
    starts = np.flatnonzero(np.r_[True, stage[1:] != stage[:-1]]) if n else np.zeros(0, dtype=np.int64)
    within = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))  # n-th of its stage
    if ip.type == "shared_prefix":
        return _shared_prefix(ip.shared_prefix, within, first_id, rng)
    return _random(ip, within, largest_stage, rng, src)


def _shared_prefix(sp, within: np.ndarray, first_id: int, rng: np.random.Generator):
    groups, per = sp.num_groups, sp.num_prompts_per_group
    # prompt p (in generation order) belongs to group p // per; the shuffled list's slot i
    # holds prompt order[i]
    order = rng.permutation(groups * per)
    prompt = order[within % (groups * per)]
    segments_of = []
    for p in range(groups * per):
        runs = []
        if sp.system_prompt_len:
            runs.append((first_id + p // per, sp.system_prompt_len))
        if sp.question_len:
            runs.append((first_id + groups + p, sp.question_len))
        segments_of.append(tuple(runs))
    lengths = np.full(len(within), sp.system_prompt_len + sp.question_len, dtype=np.int64)
    output = np.full(len(within), sp.output_len or DEFAULT_MAX_TOKENS, dtype=np.int64)
    return lengths, output, [segments_of[p] for p in prompt.tolist()]


def _random(ip, within: np.ndarray, need: int, rng: np.random.Generator, src: str):
    dists = []
    for name in ("input_distribution", "output_distribution"):
        dist = getattr(ip, name)
        if dist.total_count is None:  # main.py: the largest stage's count, plus one
            dist = dist.model_copy(update={"total_count": need + 1})
        elif dist.total_count < need:
            raise InputError(
                src,
                f"workload.inference_perf.{name}.total_count",
                f"{dist.total_count} lengths for a stage of {need} requests "
                "(inference-perf fails with an IndexError); raise it or leave it out",
            )
        dists.append(dist)
    prompt = clipped_normal(dists[0], rng)[within]
    output = clipped_normal(dists[1], rng)[within]
    return prompt, np.where(output == 0, DEFAULT_MAX_TOKENS, output), None
