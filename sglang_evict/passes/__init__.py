"""The eviction pass: everything that runs between two decode steps to evict, compact
and free pages, and the state it keeps per request.

Policy is pure (host ints or tensors in, a decision out, nothing kept); the mechanism
owns state (per-request positions, the pool's slots, the allocator's pages, leases).
``manager.EvictionManager`` is the one entry: SGLang's adapter (``sglang_evict.srt``)
and the CPU driver call it, nothing else in this package is called from outside but
the data types and the pure references.

    module       job                                          kind        host reads
    manager      ``EvictionManager``: per-request state,      stateful    lengths it
                 due checks, one batched pass per decode                  knows
                 step, commit, invariants (``check_request``)
    state        the mechanism's data types: what it needs    types       -
                 of a pool (``KVPoolAccess``), due requests,
                 per-request state, pass results
    host_work    a pass's requests as columns of host ints;   pure        lengths
                 committing their new states                  (+ commit)
    device_work  a pass's device work: gather, score,         stateful    nothing
                 select, plan, moves and row writes           (device)
    moves        moving the slots: in-process (one repack     stateful    nothing
                 launch) or through the sidecar, staging                  (in-process)
                 pages, completing a pass a failure cut
    graphs       passes replayed as CUDA graphs, one per      stateful    nothing
                 bucketed shape; the graphs' pool
    grouping     how many decode steps one pass serves        policy      host clock
                 (fixed or ``auto``)                          (+ tally)
    lease        the pass lease (fencing token) and shared-   stateful    -
                 page pins in the lease store
    failures     why a pass failed (cause, knob), backoff     stateful    -
                 of its requests, the log lines
    tensor_pool  ``KVPoolAccess`` over plain tensors (the     stateful    -
                 benches, the ``meta``-device tests)
    batch/       the batched pass's policy: counts, scores,   pure        lengths
                 survivors, plans as tensor ops (its own
                 table)
    selection    survivors of one request (the reference      pure        -
                 ``batch.select`` is held to)
    planner      one request's compaction plan in numpy       pure        -
                 (the reference ``batch.plan`` is held to;
                 the sidecar's host plans)

Who may import what: policy modules (``batch``, ``selection``, ``planner``,
``grouping``) import no mechanism module; ``manager`` is imported by nothing here.
"""
