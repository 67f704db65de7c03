"""SGLang's admission of requests that run to their max_new_tokens (the client's
`ignore_eos`), as SGLang 0.5.23 tests it (python/sglang/srt/managers/schedule_policy.py).

Such a request's remaining output is reserved whole: a running request reserves
min(max_new_tokens - output, 4,096) times 1.0, not times the new-token ratio
(`PrefillAdder._get_running_request_total_token_offset`). Where the radix cache is off
(`--disable-radix-cache`: the tree's `disable`), a waiting one takes another test
instead of the ordinary one (`add_one_req` hands it to `add_one_req_ignore_eos`):

1. its tokens in whole pages and one page more must fit what is free less this pass's
   reservations, for inputs and for outputs alike (`PrefillBudget.can_allocate_prefill`);
2. every request, this one, the running ones and those admitted in this pass, must be
   able to run to its end: each is (tokens left = max_new_tokens - output, tokens
   occupied = input + output); in order of tokens left, with bs requests still to
   finish and the slots the finished ones free, the free slots less this one's pages
   less bs times the i-th's tokens left must stay above bs x IGNORE_EOS_RESERVE_TOKENS
   (1). The list is built once per prefill pass, sorted, and each later candidate is
   inserted before the first entry leaving as many or more tokens, or, where none does,
   before the last one (the loop's index stops there: SGLang's, kept).
3. it is admitted whole if prefill is unchunked or the chunk left holds it (reserving
   its pages, a page and min(max_new_tokens, 4,096)); else cut to the chunk left, in
   tokens, not pages (reserving the chunk and a page), the pass ending if no chunk is left.

Nothing cached is counted, and neither max_prefill_tokens nor the input limit stops an
admission before the verdict that follows it. Decoding and retraction
(`check_decode_mem`, `retract_decode`, the ratio after a retraction) treat these requests
as any other in 0.5.23.
"""

from __future__ import annotations

from kvsim.engines.base import Request

IGNORE_EOS_RESERVE_TOKENS = 1


def state_of(req: Request) -> tuple[int, int] | None:
    """(tokens left, tokens occupied) of a request, or None if it has none left."""
    left = req.shape.output_tokens - req.generated
    return (left, req.shape.prompt_tokens + req.generated) if left > 0 else None


def insert_state(states: list[tuple[int, int]], new: tuple[int, int]) -> None:
    """Insert as SGLang does (add_req_state with insert_sort)."""
    i = 0
    for i in range(len(states)):
        if new[0] <= states[i][0]:
            break
    states.insert(i, new)


def outlast(states: list[tuple[int, int]], free: float) -> bool:
    """Whether `free` slots let every request in `states` (sorted) run to its end."""
    freed = 0
    for i, (left, occupied) in enumerate(states):
        bs = len(states) - i
        if free + freed - left * bs <= IGNORE_EOS_RESERVE_TOKENS * bs:
            return False
        freed += occupied
    return True
