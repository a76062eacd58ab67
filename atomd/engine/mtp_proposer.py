"""Speculative drafts from DeepSeek V3's MTP layer (atomd/model/deepseek_mtp.py).

Every forward of the engine runs the MTP layer over the same rows, positions and KV slots
as the main model, after sampling: row p gets the main model's hidden state h_p and the token
at p + 1, which is known for every row whose output counts: a prompt token, or this step's
sampled token (for a verify step's row j, the token sampled there; rows past the accepted
drafts get that too and write KV at positions the next step rewrites before anything reads
them). So the MTP's latent cache follows the sequence shifted by one, including chunked
prefills, prefix hits (the hit blocks' MTP rows were computed with the next token of the
sequence that stored them: a later sequence with another next token reads one stale MTP row
at the boundary, which costs acceptance, never output) and preemption (recomputed). The
draft of a sequence that sampled is the MTP's argmax at its last accepted row: the token
after the one it just got. `propose` hands it out under the SpecController's limit, as the
n-gram proposer does; the verify step keeps it only if the main model samples it.
"""
from __future__ import annotations

import numpy as np
import torch

from atomd.model.deepseek_mtp import MtpLayer, mtp_forward


class MtpProposer:
    def __init__(self, model, mtp: MtpLayer, share=None):
        self.model, self.mtp = model, mtp
        self.share = share  # under TP: share(next_ids, rows) sends them to the workers (TPWorkers.send_mtp)
        self.drafts: dict[int, int] = {}  # seq id -> its draft, from the last forward
        # the last run's drafting rows: (request ids, positions, MTP logits), for tests and debugging
        self.last: tuple[list[str], torch.Tensor, torch.Tensor] | None = None

    def run(self, batch, hidden: torch.Tensor, positions: torch.Tensor, meta, kv_cache,
            sampled: list[list[int]], accepted: list[list[int]]) -> None:
        """After a forward: the MTP layer over its rows (module docstring); `sampled[i]` the
        tokens sampled at sequence i's rows (one per row for a verify step, one for its last
        row otherwise, none if it did not sample), `accepted[i]` what it kept."""
        num = batch.num_scheduled_tokens.astype(np.int64)
        ends = np.cumsum(num)
        computed = batch.num_computed_tokens.astype(np.int64)
        next_ids = np.zeros(int(ends[-1]), dtype=np.int64)
        logits_rows, seq_ids, request_ids = [], [], []
        for i, seq in enumerate(batch.seqs):
            start, n, c = int(ends[i] - num[i]), int(num[i]), int(computed[i])
            known = seq.token_ids[c + 1:c + n + 1]  # the next token of each row, where the sequence has it
            tail = sampled[i][:n - len(known)]
            row_ids = list(known) + list(tail)
            next_ids[start:start + len(row_ids)] = row_ids
            if accepted[i]:
                logits_rows.append(start + n - len(sampled[i]) + len(accepted[i]) - 1 if len(sampled[i]) > 1
                                   else start + n - 1)
                seq_ids.append(seq.id)
                request_ids.append(seq.request_id)
        rows = torch.tensor(logits_rows, dtype=torch.int64)
        if self.share is not None:
            self.share(next_ids, rows)
        logits = mtp_forward(self.model, self.mtp, torch.from_numpy(next_ids), hidden, positions, meta, kv_cache, rows)
        self.drafts = dict(zip(seq_ids, logits.argmax(dim=-1).tolist()))
        self.last = (request_ids, positions[rows], logits)

    def propose(self, seq_ids: list[int], token_ids: list[list[int]], new: list[list[int]],
                limits: list[int]) -> list[list[int]]:
        """NgramProposer.propose's contract: each sequence's draft (at most one) under its limit."""
        return [[self.drafts[s]] if limit > 0 and s in self.drafts else [] for s, limit in zip(seq_ids, limits)]

    def forget(self, seq_id: int) -> None:
        self.drafts.pop(seq_id, None)
