"""The quantized tier in the plugin's mechanism, through the paged reference path
(SGLang's memory classes in ``MemoryDriver``, ``PagedLlama``): passes demote what they
do not keep into the tier's arena, attention merges the tier with the full-precision
pages, and finishing frees it all.
"""

from __future__ import annotations

import pytest
import torch

from sglang_evict.config import EvictionConfig
from sglang_evict.models.reference_loop import GenerationRequest, generate
from sglang_evict.models.reference_model import KVBuffers, PagedLlama, build_tiny_llama
from sglang_evict.srt.cpu_driver import MemoryDriver
from sglang_evict_kernels.tier_format import dequantize_groups_reference, quantize_groups_reference

DTYPE = torch.float32
PROMPT = [(7 * i + 3) % 256 for i in range(40)]


@pytest.fixture(scope="module")
def model():
    # head dim 64: the tier's kernels hold 64 and 128
    return PagedLlama(build_tiny_llama(seed=3, hidden_size=256, num_heads=4, num_kv_heads=2))


def tier_config(page_size, bits=3, **overrides):
    fields = dict(
        kv_budget_tokens=48,
        cadence_tokens=16,
        sink_tokens=4,
        window_tokens=16,
        scorer="knorm",
        page_size=page_size,
        tier_bits=bits,
        tier_group_tokens=16,
        tier_max_tokens=64,
    )
    fields.update(overrides)
    return EvictionConfig(**fields)


def driver_for(model, page_size, config, num_tokens=4096):
    return MemoryDriver.for_model(model, page_size=page_size, num_tokens=num_tokens, config=config)


class ReferenceChecking:
    """``PagedLlama`` whose every forward with a tier is checked against one softmax over
    a full cache holding the context's K/V and the tier's dequantized K/V."""

    def __init__(self, model) -> None:
        self._model = model
        self.checked = 0
        self.max_error = 0.0

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward(self, tokens, positions, write_slots, context_slots, context_positions, kv, **kw):
        tier = kw.get("tier")
        expected = None
        if tier is not None:
            expected = self._full_cache_logits(
                tokens, positions, write_slots, context_slots, context_positions, kv, tier
            )
        logits = self._model.forward(
            tokens, positions, write_slots, context_slots, context_positions, kv, **kw
        )
        if expected is not None:
            error = float((logits - expected).abs().max())
            self.max_error = max(self.max_error, error)
            self.checked += 1
        return logits

    def _full_cache_logits(
        self, tokens, positions, write_slots, slots, context_positions, kv, tier
    ):
        count = int(tier.num_groups[0])
        groups = tier.group_table[0, :count].long()
        ks, vs = [], []
        for layer, store in enumerate(tier.stores):
            k, v = dequantize_groups_reference(store.take(groups), tier.fmt)  # [n, G, H, D]
            heads, dim = k.shape[2], k.shape[3]
            ks.append(torch.cat([kv.k[layer][slots], k.reshape(-1, heads, dim).to(DTYPE)]))
            vs.append(torch.cat([kv.v[layer][slots], v.reshape(-1, heads, dim).to(DTYPE)]))
        n_context, n_tier = slots.numel(), ks[0].shape[0] - slots.numel()
        write_index = torch.nonzero(slots.unsqueeze(1) == write_slots.unsqueeze(0))[:, 0]
        # Every tier token precedes the query: position 0 is visible to it.
        all_positions = torch.cat([context_positions, torch.zeros(n_tier, dtype=torch.int64)])
        return self._model.forward(
            tokens,
            positions,
            write_index,
            torch.arange(n_context + n_tier),
            all_positions,
            KVBuffers(k=ks, v=vs),
        )


@pytest.mark.parametrize(
    ("page_size", "bits", "outliers"),
    [(1, 2, 0), (1, 3, 2), (1, 4, 0), (1, 8, 0), (16, 3, 2), (64, 2, 0)],
)
def test_tier_logits_equal_a_full_cache_holding_the_dequantized_values(
    model, page_size, bits, outliers
):
    checking = ReferenceChecking(model)
    config = tier_config(page_size, bits, tier_outlier_tokens=outliers)
    driver = driver_for(model, page_size, config)
    requests = [GenerationRequest(f"r{i}", PROMPT[i:] + PROMPT[:i], 100) for i in range(2)]
    result = generate(driver, checking, requests)
    assert sum(p.tokens_demoted for _, _, p in result.passes) > 0
    assert any(p.tokens_dropped for _, _, p in result.passes)  # the bound was reached
    assert checking.checked > 100
    assert checking.max_error < 1e-4, checking.max_error
    assert driver.tier_arena.free_groups == driver.tier_arena.num_groups


class CheckingDriver(MemoryDriver):
    """A driver that checks, around every decode step's pass: the allocator gained
    exactly the pages the passes freed, every full-precision survivor is bit-identical
    in its new slot, the mechanism's and the arena's invariants hold."""

    steps_with_passes = 0

    def prepare_decode(self, reqs):
        before = {}
        for req in reqs:
            slots, positions = self.row(req), self.positions(req)
            before[req.rid] = {
                int(p): (self.kv_pool.k_buffer[1][s].clone(), self.kv_pool.v_buffer[1][s].clone())
                for p, s in zip(positions.tolist(), slots.tolist(), strict=True)
            }
        free_before = self.free_tokens()
        out_slots, positions, passes = super().prepare_decode(reqs)
        freed = sum(p.pages_freed for p in passes if p is not None) * self.page_size
        if freed:
            self.steps_with_passes += 1
            # the step's own decode slots came after the pass's frees
            new_pages = sum(
                1 for req in reqs if (self.kv(req).kv_committed_len - 1) % self.page_size == 0
            )
            assert self.free_tokens() - free_before + new_pages * self.page_size == freed
        manager = self.evictor
        for req in reqs:
            kv_len = self.kv(req).kv_committed_len - 1  # the new token is not written yet
            manager.check_request(req.rid, kv_len)
            row = self.row(req)[:kv_len]
            for p, s in zip(self.positions(req)[:kv_len].tolist(), row.tolist(), strict=True):
                k, v = before[req.rid][p]
                assert torch.equal(self.kv_pool.k_buffer[1][s], k)
                assert torch.equal(self.kv_pool.v_buffer[1][s], v)
        bound = manager.tier_policy.max_tier_tokens // manager.tier_policy.group_tokens
        self.tier_arena.check(bound)
        return out_slots, positions, passes


@pytest.mark.parametrize(("page_size", "compaction"), [(1, "hole_fill"), (16, "repack")])
def test_tier_passes_free_pages_keep_survivors_and_free_the_arena(model, page_size, compaction):
    config = tier_config(page_size, 3, compaction=compaction)
    driver = CheckingDriver.for_model(model, page_size=page_size, num_tokens=4096, config=config)
    requests = [
        GenerationRequest("a", PROMPT, 90),
        GenerationRequest("b", PROMPT[5:], 70, arrival_step=10),
    ]
    result = generate(driver, model, requests)
    assert driver.steps_with_passes >= 3
    held = [p for _, _, p in result.passes]
    assert all(p.tokens_demoted % 16 == 0 for p in held)
    # Full precision after a pass: the budget, plus the tokens waiting for a group.
    assert all(p.tokens_after < 48 + 16 for p in held)
    arena = driver.tier_arena
    assert arena.free_groups == arena.num_groups and not arena.owned
    assert driver.evictor.num_tracked_requests() == 0


def test_retraction_frees_the_requests_tier(model):
    driver = driver_for(model, 16, tier_config(16, 4))
    req, _, _ = driver.admit("a", PROMPT)
    driver.prefill_done(req)
    seen = 0
    for _ in range(60):
        driver.prepare_decode([req])
        req.output_ids.append(1)
        seen = max(seen, driver.tier_tokens(req))
    assert seen > 0
    driver.evictor.forget(req.rid)  # what the plugin's release path does
    driver.retract(req)
    assert driver.tier_arena.free_groups == driver.tier_arena.num_groups


def test_the_arena_is_a_share_of_the_kv_memory_and_sized_by_the_formula(model):
    config = tier_config(16, 3, tier_outlier_tokens=2, tier_pool_share=0.25)
    driver = driver_for(model, 16, config, num_tokens=4096)
    arena, fmt = driver.tier_arena, driver.tier_arena.fmt
    slot_bytes = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 4
    assert driver.num_tokens * slot_bytes + arena.nbytes() <= 4096 * slot_bytes
    assert arena.nbytes() >= 0.25 * 4096 * slot_bytes * 0.95
    for layer, store in enumerate(arena.stores):
        per_token_head = fmt.bytes_per_token_head(DTYPE, outliers=fmt.outliers_for_layer(layer))
        expected = per_token_head * fmt.group_tokens * model.num_kv_heads * store.num_slots
        assert store.nbytes() == pytest.approx(expected, abs=0.5)
    # packed for real: bits / 8 bytes per element
    assert arena.stores[0].k_codes.shape[-1] == model.head_dim * 3 // 8


def test_demotion_writes_the_reference_quantizers_bytes_of_the_tokens_not_kept():
    from sglang_evict.tier import demotion
    from sglang_evict.tier.arena import TierArena
    from sglang_evict_kernels.tier_format import TierFormat

    fmt = TierFormat(bits=3, group_tokens=8, outlier_tokens=1, head_dim=64)
    layers, heads, n = 3, 2, 40
    generator = torch.Generator().manual_seed(5)
    k = [torch.randn(64, heads, 64, generator=generator) for _ in range(layers)]
    v = [torch.randn(64, heads, 64, generator=generator) for _ in range(layers)]
    arena = TierArena(fmt, num_groups=6, num_layers=layers, kv_heads=heads, full_dtype=DTYPE)
    slots = torch.randperm(64, generator=generator)[:n].unsqueeze(0)
    positions = torch.arange(n).flip(0).unsqueeze(0)  # row order is not position order
    keep = torch.zeros(1, n, dtype=torch.bool)
    keep[0, ::5] = True  # 8 kept, 32 cold: 4 groups
    prepared = demotion.prepare(
        arena,
        rids=["a"],
        demoted_tokens=[32],
        max_groups=[3],  # one group over the bound
        slots=slots,
        positions=positions,
        valid=torch.ones(1, n, dtype=torch.bool),
        keep=keep,
        scores=torch.rand(1, n, generator=generator),
        k_buffers=k,
        v_buffers=v,
    )
    assert arena.free_groups == 6  # nothing taken before the commit
    demotion.commit(arena, prepared)
    assert len(arena.groups_of("a")) == 3 and arena.free_groups == 3
    arena.check(3)
    cold = torch.nonzero(~keep[0])[:, 0]
    cold = cold[torch.argsort(positions[0, cold])]  # position order
    cold_slots = slots[0, cold].view(4, 8)
    kept = prepared.targets != arena.trash
    assert int(kept.sum()) == 3
    for layer in range(layers):
        reference = quantize_groups_reference(
            k[layer][cold_slots[kept]],
            v[layer][cold_slots[kept]],
            fmt,
            fmt.outliers_for_layer(layer),
        )
        stored = arena.stores[layer].take(prepared.targets[kept])
        for name, tensor in reference.tensors().items():
            assert torch.equal(getattr(stored, name), tensor), (layer, name)


def test_a_full_tier_gives_up_its_lowest_scored_groups_old_or_new():
    from sglang_evict.tier.arena import TierArena
    from sglang_evict.tier.demotion import _targets
    from sglang_evict_kernels.tier_format import TierFormat

    fmt = TierFormat(bits=4, group_tokens=8, head_dim=64)
    arena = TierArena(fmt, num_groups=8, num_layers=1, kv_heads=1, full_dtype=DTYPE)
    old = arena.take("a", 3)  # slots 0, 1, 2
    arena.scores[torch.tensor(old)] = torch.tensor([5.0, 1.0, 3.0])
    fresh = torch.tensor(arena.peek(1))
    # 3 old + 3 new, room for 4: the two lowest go (old 1.0, new 0.5).
    targets = _targets(arena, old, fresh, torch.tensor([4.0, 0.5, 2.0]), dropped=2, device="cpu")
    assert targets.tolist() == [fresh.item(), arena.trash, old[1]]
    # Ties go to the older group: with equal scores the old one is given up.
    targets = _targets(arena, old, fresh[:0], torch.tensor([1.0]), dropped=1, device="cpu")
    assert targets.tolist() == [old[1]]


@pytest.mark.parametrize(
    ("overrides", "flag"),
    [
        ({"tier_bits": 5}, "--kv-tier-bits"),
        ({"tier_group_tokens": 24}, "--kv-tier-group"),
        ({"tier_group_tokens": 8192}, "--kv-tier-group"),
        ({"tier_group_tokens": 128}, "--kv-tier-tokens"),  # a bound of 64 holds no group
        ({"tier_max_tokens": 40}, "--kv-tier-tokens"),
        ({"tier_max_tokens": 8}, "--kv-tier-tokens"),
        ({"tier_outlier_tokens": 8}, "--kv-tier-outliers"),
        ({"tier_pool_share": 1.5}, "--kv-tier-pool-share"),
    ],
)
def test_bad_tier_flags_are_refused_naming_the_flag(overrides, flag):
    with pytest.raises(ValueError, match=flag):
        tier_config(16, **{"bits": 3, **overrides} if "tier_bits" not in overrides else overrides)


def test_a_head_dim_the_kernels_do_not_hold_is_refused_naming_the_flag():
    small = PagedLlama(build_tiny_llama(seed=3))  # head dim 16
    with pytest.raises(ValueError, match="--kv-tier-bits"):
        driver_for(small, 16, tier_config(16, 3))


def test_a_tier_pass_demotes_at_least_one_group_even_under_a_short_cadence(model):
    driver = driver_for(model, 1, tier_config(1, 3, cadence_tokens=4))
    result = generate(driver, model, [GenerationRequest("a", PROMPT, 80)])
    assert result.passes
    assert all(p.tokens_demoted >= 16 for _, _, p in result.passes)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_tier_pass_on_the_meta_device_reads_no_device_data(page_size):
    """As ``tests/test_batch_pass_meta.py``: on the ``meta`` device any host read of
    device data raises, so two passes demoting into the tier (the second past its
    bound: groups given up, chosen on the device) prove the tier's part of a pass needs
    none."""
    from sglang_evict.passes.manager import DueRequest
    from sglang_evict.tier.arena import TierArena
    from tests.test_batch_pass_meta import KV_HEADS, meta_manager

    config = tier_config(page_size, 3, tier_outlier_tokens=1)
    layers = 3  # the third holds outlier tokens
    manager, _ = meta_manager(
        config, rows=3, capacity=256, spare_pages=32, layers=layers, head_dim=64
    )
    manager.tier_arena = TierArena(
        manager.tier_policy.fmt,
        num_groups=16,
        num_layers=layers,
        kv_heads=KV_HEADS,
        full_dtype=DTYPE,
        device="meta",
    )
    lengths = {"a": 48 + 40, "b": 48 + 56}
    for _ in range(3):
        due = [DueRequest(rid, r, n, 0, 16) for r, (rid, n) in enumerate(lengths.items())]
        results = {r.rid: r for r in manager.run_batch_pass(due)}
        for rid, n in lengths.items():
            cold = n - 48
            assert results[rid].tokens_demoted == cold - cold % 16
            assert results[rid].tokens_after == 48 + cold % 16
        lengths = {rid: 48 + 16 + 20 for rid in lengths}
    manager.tier_arena.check(4)
    assert any(r.tokens_dropped for r in results.values())


def test_a_request_sets_its_own_tier_bound_within_the_servers(model):
    """``custom_params.sglang_evict.tier_tokens``: 0 turns the tier off for the request
    (what a pass does not keep is evicted, as without a tier); a smaller bound holds."""
    driver = driver_for(model, 16, tier_config(16, 3, tier_max_tokens=64))
    requests = [
        GenerationRequest("server", PROMPT, 90),
        GenerationRequest("off", PROMPT, 90, custom_params={"sglang_evict": {"tier_tokens": 0}}),
        GenerationRequest("one", PROMPT, 90, custom_params={"sglang_evict": {"tier_tokens": 16}}),
    ]
    peak = {r.rid: 0 for r in requests}

    def on_step(step, result):
        for req in driver.running.values():
            peak[req.rid] = max(peak[req.rid], driver.tier_tokens(req))

    result = generate(driver, model, requests, on_step=on_step)
    passes = {rid: [p for r, _, p in result.passes if r == rid] for rid in peak}
    assert peak == {"server": 64, "off": 0, "one": 16}
    assert all(p.tokens_demoted == 0 for p in passes["off"])
    # as without a tier: the protected prompt (40) and window (16) over the budget, and
    # no token waits for a group
    assert passes["off"] and all(p.tokens_after == 40 + 16 for p in passes["off"])
    assert any(p.tokens_dropped for p in passes["one"])


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (24, "whole groups of 16 tokens"),
        (128, r"out of range; allowed: \[0, 64\]"),
        (-16, "out of range"),
        ("16", "must be an integer"),
    ],
)
def test_a_bad_tier_bound_in_a_request_is_refused_naming_the_field(model, value, message):
    from sglang_evict.request_policy import RequestPolicyError

    driver = driver_for(model, 16, tier_config(16, 3, tier_max_tokens=64))
    with pytest.raises(RequestPolicyError, match=message) as error:
        driver.admit("a", PROMPT, custom_params={"sglang_evict": {"tier_tokens": value}})
    assert error.value.field == "tier_tokens"
    assert not driver.running


def test_a_tier_bound_on_a_server_without_a_tier_is_refused(model):
    from sglang_evict.request_policy import RequestPolicyError

    config = tier_config(16, None)
    driver = driver_for(model, 16, config)
    with pytest.raises(RequestPolicyError, match="runs no quantized tier"):
        driver.admit("a", PROMPT, custom_params={"sglang_evict": {"tier_tokens": 32}})


class TierPassRun:
    """A manager, its pool and its tier arena on ``device``, built from the same seeded
    CPU tensors whatever the device (head dim 64, 2 KV heads, 3 layers: the third with
    outlier tokens), and four requests that keep growing past their budget and tier."""

    ROWS, CAPACITY, LAYERS, KV_HEADS, HEAD_DIM = 4, 512, 3, 2, 64

    def __init__(self, device: str, compaction: str) -> None:
        from sglang_evict.passes.manager import EvictionManager
        from sglang_evict.passes.tensor_pool import TensorPool
        from sglang_evict.tier.arena import TierArena

        config = tier_config(
            16, 3, scorer="streaming", compaction=compaction, tier_outlier_tokens=1
        )
        slots = (self.ROWS * self.CAPACITY // 16 + 16) * 16
        g = torch.Generator().manual_seed(11)

        def buffer():
            return torch.randn(slots, self.KV_HEADS, self.HEAD_DIM, generator=g).to(device)

        self.pool = TensorPool(
            k_buffers=[buffer() for _ in range(self.LAYERS)],
            v_buffers=[buffer() for _ in range(self.LAYERS)],
            page_size=16,
            rows=self.ROWS,
            capacity=self.CAPACITY,
        )
        self.manager = EvictionManager(
            config=config,
            pool=self.pool,
            compactor=None,
            num_request_rows=self.ROWS,
            row_capacity=self.CAPACITY,
            device=device,
            static_shapes=True,
        )
        arena = TierArena(
            self.manager.tier_policy.fmt,
            num_groups=self.ROWS * 4 - 2,  # short by two: a pass may find it full
            num_layers=self.LAYERS,
            kv_heads=self.KV_HEADS,
            full_dtype=DTYPE,
            device=device,
        )
        arena.enable_rows(self.ROWS, config.tier_max_tokens // config.tier_group_tokens)
        self.manager.tier_arena = arena
        self.lengths = {f"r{r}": 0 for r in range(self.ROWS)}
        for r, rid in enumerate(self.lengths):
            self.grow(rid, r, 48 + 24 + 8 * r)

    def grow(self, rid: str, row: int, count: int) -> None:
        from tests.test_static_shape_pass import append_tokens

        append_tokens(self.pool, row, self.lengths[rid], count)
        self.lengths[rid] += count

    def step(self) -> list[tuple]:
        from sglang_evict.passes.manager import DueRequest

        due = [DueRequest(rid, r, n, 0, 16) for r, (rid, n) in enumerate(self.lengths.items())]
        results = self.manager.run_batch_pass(due)
        for r, rid in enumerate(self.lengths):
            self.lengths[rid] = next(x.tokens_after for x in results if x.rid == rid)
            self.manager.check_request(rid, self.lengths[rid])
            self.grow(rid, r, 40)
        return [
            (x.rid, x.tokens_after, x.tokens_demoted, x.tokens_dropped, x.pages_freed)
            for x in results
        ]

    def tensors(self) -> dict[str, torch.Tensor]:
        arena, pool = self.manager.tier_arena, self.pool
        found = {"free pages": pool.free, "row table": arena.row_table}
        found["row counts"] = arena.row_counts
        found["group scores"] = arena.scores
        for rid, n in self.lengths.items():
            row = self.manager.states[rid].req_pool_idx
            found[f"{rid} slots"] = pool.req_to_token[row, :n]
            found[f"{rid} positions"] = self.manager.positions(rid, n)
        for layer in range(self.LAYERS):
            found[f"layer {layer} K"] = pool.k_buffers[layer]
            found[f"layer {layer} V"] = pool.v_buffers[layer]
            for i, t in enumerate(arena.stores[layer].kernel_args()):
                found[f"layer {layer} store {i}"] = t
        return {name: t.cpu() for name, t in found.items()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compaction", ["hole_fill", "repack"])
def test_tier_passes_on_a_gpu_equal_the_cpus(compaction):
    """The tier's part of a pass on CUDA (the Triton quantize-and-pack, the groups given
    up chosen on the device, the row tables) leaves the pool, the arena and the results
    bit for bit as the CPU's reference path does. ``streaming`` scores positions, so no
    near-tie of float scores can split the two."""
    runs = {device: TierPassRun(device, compaction) for device in ("cpu", "cuda")}
    dropped = 0
    for _ in range(4):
        results = {device: run.step() for device, run in runs.items()}
        assert results["cuda"] == results["cpu"]
        dropped += sum(r[3] for r in results["cpu"])
        on_cpu, on_gpu = (run.tensors() for run in runs.values())
        differ = [name for name in on_cpu if not torch.equal(on_cpu[name], on_gpu[name])]
        assert not differ, differ
    runs["cuda"].manager.tier_arena.check(4)  # tier_max_tokens / tier_group_tokens
    assert dropped > 0  # tiers filled and gave groups up


def test_a_sidecar_commit_takes_its_claimed_slots_and_frees_what_its_swaps_replace():
    """``take_claimed``: two requests claimed the next free slots in order; each keeps
    the slots it used, gives up the old slots its swaps replaced, and the claimed slots
    it did not use go back; a commit whose claims are no longer the next free slots is
    refused before anything changes."""
    from sglang_evict.tier.arena import TierArena
    from sglang_evict_kernels.tier_format import TierFormat

    fmt = TierFormat(bits=4, group_tokens=8, head_dim=64)
    arena = TierArena(fmt, num_groups=10, num_layers=1, kv_heads=1, full_dtype=DTYPE)
    arena.enable_rows(4, 4)
    old_a = arena.take("a", 2, row=0)  # slots 0, 1
    claims = arena.peek(5)  # a claims 3 (uses 2: one fresh, one swap), b claims 2
    arena.take_claimed([("a", 0, claims[:3], 2, [old_a[1]]), ("b", 1, claims[3:], 2, [])])
    assert sorted(arena.groups_of("a")) == sorted([old_a[0], *claims[:2]])
    assert arena.groups_of("b") == claims[3:]
    assert arena.free_groups == 10 - 3 - 2
    assert claims[2] in arena.peek(arena.free_groups) and old_a[1] in arena.peek(arena.free_groups)
    arena.check(4)
    before = (dict(arena.owned), arena.free_groups)
    with pytest.raises(AssertionError, match="no longer the next free"):
        arena.take_claimed([("b", 1, [old_a[0]], 1, [])])  # a's slot: not free
    assert (dict(arena.owned), arena.free_groups) == before
