"""Tensor parallelism: ranks hold different KV heads but must keep identical survivors.

Two real processes joined in a gloo group (SGLang's cache group is a gloo CPU group),
each with its own SGLang memory classes holding half of the KV heads (and, for the
query-reading scorers, a query ring holding the query heads of those KV heads, as each
rank's attention captures its own), run the same request through the plugin with the
cross-rank score reduction; a single process holding all heads is the reference.
With the quantized tier each rank's arena holds its own KV heads' groups; the ranks
demote the same tokens into the same group slots and give up the same groups, as the
single process does.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback

import pytest
import torch

NUM_LAYERS, HEAD_DIM, GLOBAL_KV_HEADS, GROUP, PAGE_SIZE = 2, 8, 4, 2, 16
TIER_HEAD_DIM = 64  # the tier's kernels hold head dims 64 and 128
PROMPT = list(range(3, 11))  # short: most survivors are chosen by score
NEW_TOKENS = 150
SCORERS = ["knorm", "window", "rkv"]
TIER = "knorm+tier"  # knorm with a 3-bit tier of at most 4 groups of 16: it fills, then drops
RUNS = [*SCORERS, TIER]
# One worker computes the two ranks for every test here (as two would, twice: on two cores
# four lock-stepped rank processes slow each other down by minutes).
pytestmark = pytest.mark.xdist_group("tensor-parallel")


def global_kvq(
    token: int, position: int, head_dim: int = HEAD_DIM
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, values ``[layers, kv_heads, D]`` and queries ``[layers, kv_heads * GROUP, D]``
    of a token at a position, every head (query head h reads KV head h // GROUP)."""
    generator = torch.Generator().manual_seed(token * 7919 + position)
    shape = (NUM_LAYERS, GLOBAL_KV_HEADS, head_dim)
    k, v = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    q = torch.randn(NUM_LAYERS, GLOBAL_KV_HEADS * GROUP, head_dim, generator=generator)
    return k, v, q


def run_request(heads: slice, run: str, reducer=None) -> list:
    """Decode one request holding KV heads ``heads`` (and their query heads); return,
    after each pass, the logical positions kept (and with the tier its group slots,
    their scores and its tokens)."""
    from sglang_evict.config import EvictionConfig
    from sglang_evict.srt.cpu_driver import MemoryDriver

    tier = run == TIER
    fields = dict(
        kv_budget_tokens=48,
        cadence_tokens=16,
        window_tokens=16,
        scorer="knorm" if tier else run,
        page_size=PAGE_SIZE,
        query_window_tokens=8,
    )
    if tier:
        fields.update(tier_bits=3, tier_group_tokens=16, tier_max_tokens=64, tier_pool_share=0.5)
    config = EvictionConfig(**fields)
    head_dim = TIER_HEAD_DIM if tier else HEAD_DIM
    num_kv_heads = heads.stop - heads.start
    driver = MemoryDriver(
        page_size=PAGE_SIZE,
        num_tokens=2048,
        num_layers=NUM_LAYERS,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        config=config,
        num_q_heads=num_kv_heads * GROUP,
    )
    manager = driver.evictor
    manager.score_reducer = reducer
    q_heads = slice(heads.start * GROUP, heads.stop * GROUP)

    def write(slot: int, token: int, position: int) -> None:
        k, v, q = global_kvq(token, position, head_dim)
        for layer in range(NUM_LAYERS):
            driver.kv_pool.k_buffer[layer][slot] = k[layer, heads]
            driver.kv_pool.v_buffer[layer][slot] = v[layer, heads]
        if manager.query_ring is not None:  # what this rank's attention captures
            queries = q[:, q_heads].unsqueeze(1)
            manager.record_queries(driver.kv(req).req_pool_idx, queries, torch.tensor([position]))

    req, prefix_len, slots = driver.admit("a", PROMPT)
    for position, slot in zip(range(prefix_len, len(PROMPT)), slots.tolist(), strict=True):
        write(slot, PROMPT[position], position)
    driver.prefill_done(req)
    kept = []
    for step in range(NEW_TOKENS):
        token = (step * 37) % 251
        slots, positions, passes = driver.prepare_decode([req])
        if passes[0] is not None:
            record = sorted(driver.positions(req).tolist())
            if tier:
                arena = driver.tier_arena
                slots = arena.groups_of("a")
                scores = [round(float(arena.scores[slot]), 5) for slot in slots]
                record = (record, slots, scores, passes[0].tokens_demoted)
            kept.append(record)
        write(int(slots[0]), token, int(positions[0]))
        req.output_ids.append(token)
    return kept


def rank_main(rank: int, world_size: int, init_file: str, results) -> None:
    """One rank: its survivors for every run, or the error it met, on ``results``; then
    it leaves at once. Tearing down an interpreter that imported SGLang takes seconds
    (minutes on a loaded 2-core machine) and proves nothing here."""
    os.environ.setdefault("TRITON_INTERPRET", "1")  # spawned: conftest did not run here
    torch.set_num_threads(1)  # tiny tensors: spinning OpenMP threads only slow the peer
    status = 1
    try:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        from sglang_evict.srt.tp import tp_score_reducer

        share = GLOBAL_KV_HEADS // world_size
        heads = slice(rank * share, (rank + 1) * share)
        reducer = tp_score_reducer(dist.group.WORLD, "mean")
        results.put((rank, {run: run_request(heads, run, reducer) for run in RUNS}))
        dist.destroy_process_group()
        status = 0
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()  # what was put is in the pipe
        os._exit(status)


@pytest.fixture(scope="module")
def kept_by_rank(tmp_path_factory) -> dict[int, dict[str, list]]:
    """Two ranks in one gloo group, each running the request once per scorer (one pair
    of processes for every scorer: starting them is what costs)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    world_size = 2
    init_file = str(tmp_path_factory.mktemp("gloo") / "gloo-init")
    workers = [
        context.Process(target=rank_main, args=(rank, world_size, init_file, results))
        for rank in range(world_size)
    ]
    for worker in workers:
        worker.start()
    kept = {}
    try:
        while len(kept) < world_size:
            rank, result = results.get(timeout=900)
            assert not isinstance(result, str), f"rank {rank} failed:\n{result}"
            kept[rank] = result
        for worker in workers:
            worker.join(timeout=120)
    finally:  # a failed rank leaves its peer waiting in a collective
        for worker in workers:
            if worker.is_alive():
                worker.kill()
    assert [worker.exitcode for worker in workers] == [0] * world_size
    return kept


@pytest.mark.parametrize("scorer", SCORERS)
def test_tensor_parallel_ranks_keep_the_survivors_of_a_single_rank_with_all_heads(
    kept_by_rank, scorer
):
    reference = run_request(slice(0, GLOBAL_KV_HEADS), scorer)
    assert len(reference) >= 3
    assert kept_by_rank[0][scorer] == kept_by_rank[1][scorer] == reference
    # Without the reduction, each rank alone would disagree with the reference.
    assert run_request(slice(0, 2), scorer) != reference


def test_tensor_parallel_ranks_demote_and_drop_the_groups_of_a_single_rank(kept_by_rank):
    """With the tier: the same survivors, the same tier groups in the same slots with the
    same scores, the same tokens demoted per pass, on both ranks and in the single
    process holding every head; and the tier filled (it gave groups up)."""
    reference = run_request(slice(0, GLOBAL_KV_HEADS), TIER)
    assert len(reference) >= 3
    assert kept_by_rank[0][TIER] == kept_by_rank[1][TIER] == reference
    assert any(demoted > 0 for *_, demoted in reference)
    assert len(reference[-1][1]) == 4  # the bound: the tier was full and dropped groups
