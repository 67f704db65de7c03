"""CUDA graphs as vLLM V1 runs them: which steps replay a captured graph, at what size.

vLLM 0.33.0 captures CUDA graphs at start-up for a list of batch sizes in tokens and,
in its default mode FULL_AND_PIECEWISE (vllm/config/compilation.py `CUDAGraphMode`),
runs each step one of three ways:

- full: a uniform decode batch (every sequence decodes one token) replays one graph
  of the whole forward pass, attention included: the CPU issues one launch per step;
- piecewise: a batch that holds prompt tokens replays the graphs of the pieces between
  the attention layers, and attention itself runs eagerly in between, launched layer by
  layer;
- eager: a batch larger than the largest captured size runs without graphs, every
  kernel of every layer launched by the CPU.

A graph is replayed at the smallest captured size that holds the step's tokens, so the
linear layers compute on the padded size (the padding tokens' attention is empty).

The captured sizes (vllm/config/vllm.py `VllmConfig._set_cudagraph_sizes`): 1, 2, 4,
then every multiple of 8 below 256, then every multiple of 16 from 256, up to
min(2 x max_num_seqs, 512) (1024 on data-centre Blackwell GPUs) and never beyond
max_num_batched_tokens, plus max_num_batched_tokens and max_num_seqs themselves where
they fit under that ceiling.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

DEFAULT_CEILING = 512  # 1024 on data-centre Blackwell (not among kvsim's GPUs)


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, ceiling: int = DEFAULT_CEILING) -> tuple[int, ...]:
    """vLLM 0.33.0's default capture sizes for one token per decoding sequence."""
    top = min(2 * max_num_seqs, ceiling)
    decode = [max_num_seqs] if max_num_seqs <= top else []
    top = min(top, max_num_batched_tokens)
    sizes = [s for s in (1, 2, 4) if s <= top]
    sizes += list(range(8, min(top + 1, 256), 8)) if top >= 8 else []
    sizes += list(range(256, top + 1, 16)) if top >= 256 else []
    if max_num_batched_tokens <= top:
        sizes.append(max_num_batched_tokens)
    sizes += [s for s in decode if s <= max_num_batched_tokens]
    return tuple(sorted(set(sizes)))


@dataclass(frozen=True)
class CudaGraphs:
    """The captured sizes of one engine configuration and the mode of each step."""

    sizes: tuple[int, ...]

    @classmethod
    def vllm(cls, max_num_seqs: int, max_num_batched_tokens: int) -> "CudaGraphs":
        return cls(capture_sizes(max_num_seqs, max_num_batched_tokens))

    def padded(self, tokens: int) -> int | None:
        """The captured size a step of `tokens` replays, or None (eager)."""
        i = bisect.bisect_left(self.sizes, tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def mode(self, tokens: int, sequences: int) -> str:
        """ "full", "piecewise" or "eager" for a step of `tokens` over `sequences` (see the
        module docstring). A batch is uniform when every sequence computes one token, as
        vLLM's model runner tests it (a prompt chunk of one token counts as a decode)."""
        if self.padded(tokens) is None:
            return "eager"
        return "full" if tokens == sequences else "piecewise"
