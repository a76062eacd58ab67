"""One token's logprob entry, from the sampler to the client: the engine's sampler (and the
simulated runner) make it, the scheduler sums it for best_of, the IPC carries it, a prefill
engine sends its first token's (and the prompt's) to the decode engine in kv_transfer_params,
the API renders it in the OpenAI shapes. On the JSON wire it is `{"logprob", "top", "rank"?}`."""
from __future__ import annotations

from typing import Annotated

import msgspec

# entries of one position's `top` a producer may send (the API asks for at most 20)
MAX_TOP_LOGPROBS = 64
TokenId = Annotated[int, msgspec.Meta(ge=0)]


class Logprob(msgspec.Struct, omit_defaults=True):
    logprob: float  # of the chosen (or prompt) token
    # the most likely tokens at this position, most likely first: (token id, logprob)
    top: Annotated[list[tuple[TokenId, float]], msgspec.Meta(max_length=MAX_TOP_LOGPROBS)] = []
    rank: int | None = None  # prompt tokens: the chosen token's rank (1 = most likely)
