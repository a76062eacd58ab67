"""DeepSeekMoE under expert parallelism (`--enable-expert-parallel`, atomd/model/expert_parallel.py):
the family's own routing (V2 group-limited softmax, V3 sigmoid noaux_tc with the correction
bias, x routed_scaling_factor) goes into the exchange, shared experts stay on every rank. Two
sharded engines in one process (tests/test_expert_parallel.py's Ranks) against Hugging Face's
greedy tokens and a DP=1 engine, on tiny random V2-Lite- and V3-shaped checkpoints; and V3's MTP
drafter under expert parallelism (its layer's experts sharded and exchanged, k passes a step on
every rank) against HF, a DP=1 MTP engine and the reference MTP chain."""
from __future__ import annotations

import json
import pathlib

import pytest
import torch

from tests.families import FAMILIES
from tests.test_deepseek_mtp import MTP3, assert_chains_equal_the_reference, reference_mtp, write_v3_with_mtp
from tests.test_expert_parallel import GREEDY, Ranks, busy_ticks, one_engine_greedy
from tests.test_model_hf import BLOCK, hf_greedy, prompts_of

pytestmark = [pytest.mark.unit, pytest.mark.timeout(240)]
torch.set_num_threads(1)

NAMES = ["v2-lite", "v3"]  # 8 routed experts in 4 groups, 2 groups chosen: 4 experts a rank
PROMPTS = prompts_of([5, 3 * BLOCK + 7, 1, 40], seed=15)
LONG = prompts_of([200] * 3, seed=16)  # one 600-row prefill: more rows than a tile (decoder.ROW_TILE)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, pathlib.Path]:
    return {name: FAMILIES[f"deepseek-{name}"].write(tmp_path_factory.mktemp(name)) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_ep2_greedy_equals_hf_and_dp1(name, checkpoints):
    path = checkpoints[name]
    ranks = Ranks(path)
    for engine in ranks.engines:  # each rank holds half of every sparse layer's routed experts
        sparse = [w for w in engine.model.layers if w.moe is not None]
        assert sparse and all(w.moe.gate_up.shape[0] == 4 and w.moe.ep is engine.model.ep for w in sparse)
        assert all(w.shared_gate_up is not None for w in sparse)
    # rank 0 decodes while rank 1's prompts land mid-way; then rank 1 idles while rank 0 still
    # runs, and prefills 600 rows in a step (one exchange a sparse layer all the same)
    arrivals = [{0: [("p0", PROMPTS[0]), ("p2", PROMPTS[2])], 5: [("p3", PROMPTS[3])],
                 12: [(f"long{i}", p) for i, p in enumerate(LONG)]},
                {2: [("p1", PROMPTS[1])]}]
    tokens, kinds = ranks.run(arrivals)
    placed = {rid: p for a in arrivals for batch in a.values() for rid, p in batch}
    for rid, prompt in placed.items():
        assert tokens[rid] == hf_greedy(path, prompt, 8), rid
    alone, dp1 = one_engine_greedy(path, placed)
    assert alone == {rid: tokens[rid] for rid in placed}
    pairs = set(zip(*kinds))
    assert ("decode", "prefill") in pairs or ("prefill", "decode") in pairs, kinds
    (c0, a0), (c1, a1) = ranks.counts  # the same collectives on both ranks, idle ticks included
    assert c0 == c1 == len(kinds[0])
    assert a0 == a1 == 3 * len(ranks.engines[0].model.config.sparse_layers) * busy_ticks(kinds)
    # every (token, choice) pair ran on the rank holding its expert: the two ranks' loads add up
    # to what the DP=1 engine ran
    loads = [dict(map(tuple, e.stats()["expert_tokens"])) for e in ranks.engines]
    assert set(loads[0]) == set(range(4)) and set(loads[1]) == set(range(4, 8))
    assert {**loads[0], **loads[1]} == dict(map(tuple, dp1.stats()["expert_tokens"]))
    for engine in ranks.engines:
        bm = engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_total_blocks


@pytest.mark.parametrize("tp", [1, 2])
def test_ep2_with_mtp_drafts_equals_hf_one_engine_and_the_reference(tp, tmp_path):
    """Two EP ranks of a V3 checkpoint with its MTP layer (sparse: its experts split as the main
    ones), three chained drafts a step: greedy tokens equal HF's and a DP=1 MTP engine's, every
    rank's draft chains equal the reference MTP, drafts are accepted, and both ranks ran the same
    collectives: 3 exchanges per sparse layer and per MTP pass (3 a step) every busy tick.
    tp=2 (TP x EP, DeepSeek V3's dense, shared-expert and routed layers): each rank's engine core
    (TP rank 0) holds its 4 experts of every sparse layer, the MTP layer's too, whole and runs the
    exchange, its worker holds none and adds zeros; the same tokens, chains and counts."""
    path, full, mtp = write_v3_with_mtp(tmp_path / "v3mtp", seed=51, own_head=False, mimic=True, leak=0.05)
    spec = json.dumps(MTP3)
    ranks = Ranks(path, speculative_config=spec, tensor_parallel_size=tp)
    for engine in ranks.engines:
        layer = engine.proposer.mtp.layer
        assert layer.moe.gate_up.shape[0] == 4 and layer.moe.ep is engine.model.ep
        assert layer.moe.gate_up.shape[1] == 2 * full.config.moe_intermediate_size  # whole under TP x EP
        engine.proposer.trace = []
    prompts = prompts_of([20, 9, 2 * BLOCK + 3], seed=12)
    arrivals = [{0: [("a", prompts[0])], 6: [("c", prompts[2])]}, {3: [("b", prompts[1])]}]
    tokens, kinds = ranks.run(arrivals)
    placed = {rid: p for a in arrivals for batch in a.values() for rid, p in batch}
    for rid, prompt in placed.items():
        assert tokens[rid] == hf_greedy(path, prompt, GREEDY.max_tokens), rid
    assert one_engine_greedy(path, placed, speculative_config=spec)[0] == tokens
    finals = {rid: placed[rid] + tokens[rid] for rid in placed}
    for engine in ranks.engines:
        mine = {rid: t for rid, t in finals.items() if any(rid in ids for _, ids, *_ in engine.proposer.trace)}
        assert mine and assert_chains_equal_the_reference(engine.proposer.trace, mine,
                                                          lambda t: reference_mtp(path, full, mtp, t)) > 0
    assert sum(e.stats()["spec_decode_num_accepted_tokens"] for e in ranks.engines) > 0
    (c0, a0), (c1, a1) = ranks.counts
    sparse = len(ranks.engines[0].model.config.sparse_layers)
    assert c0 == c1 == len(kinds[0])
    assert a0 == a1 == 3 * (sparse + MTP3["num_speculative_tokens"]) * busy_ticks(kinds)
    for engine in ranks.engines:
        bm = engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_total_blocks
        engine.close()  # its TP workers
