"""Expert parallelism's load balancer (`--enable-eplb --num-redundant-experts R`,
atomd/model/expert_parallel.py): the placement against hand-worked cases and its invariants,
the sharded block with replica slots against the whole block before and after a rebalance that
the load drove (the hot expert's rows then run on two ranks, every copy giving the same bits),
and two EP engines rebalancing every other step against Hugging Face."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atomd.config import EngineConfig
from atomd.model.expert_parallel import ExpertParallel, place_replicas
from atomd.model.moe import moe
from tests.in_process_group import InProcessGroup
from tests.test_expert_parallel import PROMPTS, Ranks, checkpoints, on_ranks, reference, shard  # noqa: F401
from tests.test_models import random_moe

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(240)


@pytest.mark.unit
def test_placement_by_hand():
    # 8 experts over 2 ranks (0-3 on rank 0), one replica slot each: expert 0 carries nearly all
    # the load, so its copy goes to rank 1; rank 0's other experts cannot go to rank 1 (full),
    # so rank 0's slot takes rank 1's hottest expert
    load = np.array([100, 1, 1, 1, 1, 3, 1, 1], dtype=float)
    assert place_replicas(load, 4, 2, 1).tolist() == [[5], [0]]
    # two slots each: those two leave the ranks at 54.5 / 54.5; any further copy raises one of them
    # (one of 4 on rank 0: 55 / 54), so the second slots stay empty
    assert place_replicas(load, 4, 2, 2).tolist() == [[5, -1], [0, -1]]
    # no load: nothing worth copying, every slot stays empty
    assert place_replicas(np.zeros(8), 4, 2, 1).tolist() == [[-1], [-1]]


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(ranks=st.integers(2, 4), per=st.integers(1, 4), slots=st.integers(1, 3), data=st.data())
def test_placement_invariants(ranks, per, slots, data):
    slots = min(slots, per * (ranks - 1))
    load = np.array(data.draw(st.lists(st.integers(0, 50), min_size=ranks * per, max_size=ranks * per)), float)
    held = place_replicas(load, per, ranks, slots)
    assert held.shape == (ranks, slots)
    for q, row in enumerate(held):
        mine = [e for e in row.tolist() if e >= 0]
        assert len(set(mine)) == len(mine)  # no expert twice on one rank
        assert all(e // per != q for e in mine)  # nor a copy of one it owns
        assert all(load[e] > 0 for e in mine)  # only experts with load are copied
    # the busiest rank's estimated load never grows (each copy takes a share of its expert's)
    copies = 1 + np.bincount(held[held >= 0], minlength=ranks * per)
    share = load / copies
    after = np.bincount(np.arange(ranks * per) // per, weights=share, minlength=ranks)
    for q, row in enumerate(held):
        after[q] += share[row[row >= 0]].sum()
    before = np.bincount(np.arange(ranks * per) // per, weights=load, minlength=ranks)
    assert after.max() <= before.max() + 1e-9


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replicas_follow_the_load_and_the_block_stays_exact(dtype):
    """Rows that all choose expert 0 (rank 0's): after the first rebalance rank 1 holds a copy of
    it and runs part of its rows; both ranks' outputs stay equal to the whole block's."""
    experts, ranks = 8, 2
    w = random_moe(experts=experts, dtype=dtype, seed=3)
    with torch.no_grad():
        w.router[0] += 4.0 * w.router[0].sign()  # make expert 0 everyone's first choice
    g = torch.Generator().manual_seed(2)
    hs = [[torch.randn(n, 32, generator=g).to(dtype) for n in (6, 9)] for _ in range(3)]  # 3 steps, 2 ranks
    group = InProcessGroup(ranks)

    def rank(r: int):
        mine = shard(w, r, ranks)
        ep = ExpertParallel(group.rank(r), r, ranks, redundant_experts=2, rebalance_every=1)
        mine.ep = ep
        ep.attach(mine)
        outs, replicas = [], []
        for step in hs:
            ep.anyone_has_rows(True)  # every step: a rebalance by the load so far
            replicas.append(mine.replicas.tolist())
            outs.append(moe(step[r], mine))
        return outs, replicas, mine, ep

    got = on_ranks(ranks, rank)
    # step 1: no load yet, empty slots; then expert 0's copy on rank 1 (the same placement on both)
    assert got[0][1][0] == [[-1], [-1]]
    assert got[0][1][1][1] == [0] and got[0][1][1] == got[1][1][1]
    for r in range(ranks):
        for step, out in zip(hs, got[r][0]):
            want = moe(step[r], w)
            if dtype == torch.bfloat16:
                assert torch.equal(out, want)
            else:
                torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    rank1 = got[1][2]
    assert rank1.routed[0] > 0  # rank 1 ran rows of expert 0, which it does not own
    assert torch.equal(rank1.gate_up[4], w.gate_up[0]) and torch.equal(rank1.down[4], w.down[0])
    assert torch.equal(sum(m.routed for _, _, m, _ in got), w.routed)  # each pair counted once
    assert [ep.num_rebalances for *_, ep in got] == [3, 3]


@pytest.mark.unit
def test_eplb_flags_are_checked_at_start(checkpoints):
    path = str(checkpoints["qwen3_moe"])
    with pytest.raises(ValueError, match="num_redundant_experts needs enable_eplb"):
        EngineConfig(model=path, data_parallel_size=2, enable_expert_parallel=True, num_redundant_experts=2)
    with pytest.raises(ValueError, match="enable_eplb balances expert parallelism"):
        EngineConfig(model=path, enable_eplb=True, num_redundant_experts=2)
    with pytest.raises(ValueError, match="must be a positive multiple of data_parallel_size=2"):
        EngineConfig(model=path, data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
                     num_redundant_experts=3)
    with pytest.raises(ValueError, match="5 replica slots a rank but only 4 experts it does not own"):
        EngineConfig(model=path, data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
                     num_redundant_experts=10)
    EngineConfig(model=path, data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
                 num_redundant_experts=2, eplb_step_interval=100)


@pytest.mark.unit
def test_two_ep_engines_rebalancing_every_other_step_equal_hf(checkpoints, reference):
    """The placement moves many times over the run (the load of two steps at a time); greedy
    stays HF's, both ranks hold the same placement, and replica slots ran rows."""
    ranks = Ranks(checkpoints["qwen3_moe"], enable_eplb=True, num_redundant_experts=4, eplb_step_interval=2)
    arrivals = [{0: [("p0", PROMPTS[0]), ("p1", PROMPTS[1])], 2: [("p3", PROMPTS[3])]},
                {0: [("p2", PROMPTS[2]), ("p4", PROMPTS[4])]}]
    tokens, _ = ranks.run(arrivals)
    for rid, prompt in ((rid, p) for a in arrivals for batch in a.values() for rid, p in batch):
        assert tokens[rid] == reference("qwen3_moe", prompt), rid
    eps = [e.model.ep for e in ranks.engines]
    assert eps[0].num_rebalances == eps[1].num_rebalances > 0
    assert ranks.counts[0] == ranks.counts[1]  # the same collectives on both ranks
    layers = [[w.moe for w in e.model.layers if w.moe is not None] for e in ranks.engines]
    assert all((a.replicas == b.replicas).all() for a, b in zip(*layers))
    # (token, choice) pairs of experts a rank does not own ran in its replica slots
    ran = [dict((e, n) for e, n in engine.stats()["expert_tokens"]) for engine in ranks.engines]
    assert sum(n for e, n in ran[0].items() if e >= 4) + sum(n for e, n in ran[1].items() if e < 4) > 0
