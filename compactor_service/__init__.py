"""The compactor: applies compaction plans to a KV pool (in-process or as a sidecar).

Imports only the kernels package (``sglang_evict_kernels``), never ``sglang`` or
``sglang_evict``, so it runs in a lean process.

    module        job
    plan          the compaction plan as data, checkable without the planner
    compactor     the compactor contract and its in-process implementation
    demotion      a pass's demotions: checked, then quantized into the tier's arena
    engine        the sidecar's domain logic: pools, epochs, validate, lease, kernel
    fence         the pass fence: no late kernel writes a pool given up on
    leases        who may move which pages (fencing tokens, pins), in-process
    redis_leases  the same lease store on Redis
    shared_pool   KV buffers two processes map (tmpfs on CPU)
    shared_arena  the quantized tier's arena two processes map, its layout checked
    cuda_ipc      CUDA IPC export and import of KV buffers (GPU)
    servicer      the gRPC transport: a thin servicer, listeners, health, drain
    server        the sidecar process: flags, start-up checks, supervision
    client        the scheduler's side: ``GrpcCompactor``, ``FallbackCompactor``
    wire          proto messages <-> domain types
    wire_bounds   a bounded walk of a request's bytes before parsing
    limits        bounds on what one client can make the compactor do or say
    tls           TCP addresses and TLS (mTLS) for the transport
    secrets       secrets taken from files or the environment (the Redis URL)
    runtime_dir   where the socket and pool files live; their permissions
    logs          bounded JSON log lines, credentials redacted
    tracing       OpenTelemetry names shared with the scheduler side
    health        ``sglang-evict compactor-health``, the exec probe
    v1/           code generated from ``protos/compactor_service/v1``
"""
