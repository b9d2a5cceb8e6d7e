from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Device(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEVICE_UNSPECIFIED: _ClassVar[Device]
    DEVICE_CPU: _ClassVar[Device]
    DEVICE_CUDA: _ClassVar[Device]
DEVICE_UNSPECIFIED: Device
DEVICE_CPU: Device
DEVICE_CUDA: Device

class CudaIpcBuffer(_message.Message):
    __slots__ = ("mem_handle", "storage_offset_bytes", "storage_size_bytes", "tensor_offset")
    MEM_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    mem_handle: bytes
    storage_offset_bytes: int
    storage_size_bytes: int
    tensor_offset: int
    def __init__(self, mem_handle: _Optional[bytes] = ..., storage_offset_bytes: _Optional[int] = ..., storage_size_bytes: _Optional[int] = ..., tensor_offset: _Optional[int] = ...) -> None: ...

class BufferHandle(_message.Message):
    __slots__ = ("shm_path", "offset_bytes", "cuda")
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    shm_path: str
    offset_bytes: int
    cuda: CudaIpcBuffer
    def __init__(self, shm_path: _Optional[str] = ..., offset_bytes: _Optional[int] = ..., cuda: _Optional[_Union[CudaIpcBuffer, _Mapping]] = ...) -> None: ...

class PoolLayout(_message.Message):
    __slots__ = ("num_layers", "num_slots", "num_kv_heads", "head_dim", "dtype", "page_size", "device", "device_index", "k_buffers", "v_buffers")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    K_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    V_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_slots: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    device: Device
    device_index: int
    k_buffers: _containers.RepeatedCompositeFieldContainer[BufferHandle]
    v_buffers: _containers.RepeatedCompositeFieldContainer[BufferHandle]
    def __init__(self, num_layers: _Optional[int] = ..., num_slots: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., page_size: _Optional[int] = ..., device: _Optional[_Union[Device, str]] = ..., device_index: _Optional[int] = ..., k_buffers: _Optional[_Iterable[_Union[BufferHandle, _Mapping]]] = ..., v_buffers: _Optional[_Iterable[_Union[BufferHandle, _Mapping]]] = ...) -> None: ...

class RegisterPoolRequest(_message.Message):
    __slots__ = ("layout", "client_id", "fence_file")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    FENCE_FILE_FIELD_NUMBER: _ClassVar[int]
    layout: PoolLayout
    client_id: str
    fence_file: str
    def __init__(self, layout: _Optional[_Union[PoolLayout, _Mapping]] = ..., client_id: _Optional[str] = ..., fence_file: _Optional[str] = ...) -> None: ...

class PoolLimits(_message.Message):
    __slots__ = ("max_plans_per_call", "max_moves_per_call", "max_message_bytes", "lease_ms")
    MAX_PLANS_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    MAX_MOVES_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    max_plans_per_call: int
    max_moves_per_call: int
    max_message_bytes: int
    lease_ms: int
    def __init__(self, max_plans_per_call: _Optional[int] = ..., max_moves_per_call: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class RegisterPoolResponse(_message.Message):
    __slots__ = ("pool_id", "epoch", "limits")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    limits: PoolLimits
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., limits: _Optional[_Union[PoolLimits, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("pool_id", "epoch")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_ms",)
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    lease_ms: int
    def __init__(self, lease_ms: _Optional[int] = ...) -> None: ...

class UnregisterPoolRequest(_message.Message):
    __slots__ = ("pool_id", "epoch")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class UnregisterPoolResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ArenaLayout(_message.Message):
    __slots__ = ("bits", "group_tokens", "value_group_channels", "outlier_tokens", "head_dim", "scale_dtype", "full_dtype", "num_layers", "num_slots", "num_kv_heads", "device", "device_index", "shm_path", "cuda")
    BITS_FIELD_NUMBER: _ClassVar[int]
    GROUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VALUE_GROUP_CHANNELS_FIELD_NUMBER: _ClassVar[int]
    OUTLIER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    SCALE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    FULL_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    bits: int
    group_tokens: int
    value_group_channels: int
    outlier_tokens: int
    head_dim: int
    scale_dtype: str
    full_dtype: str
    num_layers: int
    num_slots: int
    num_kv_heads: int
    device: Device
    device_index: int
    shm_path: str
    cuda: CudaIpcBuffer
    def __init__(self, bits: _Optional[int] = ..., group_tokens: _Optional[int] = ..., value_group_channels: _Optional[int] = ..., outlier_tokens: _Optional[int] = ..., head_dim: _Optional[int] = ..., scale_dtype: _Optional[str] = ..., full_dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_slots: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., device: _Optional[_Union[Device, str]] = ..., device_index: _Optional[int] = ..., shm_path: _Optional[str] = ..., cuda: _Optional[_Union[CudaIpcBuffer, _Mapping]] = ...) -> None: ...

class RegisterArenaRequest(_message.Message):
    __slots__ = ("pool_id", "epoch", "layout")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    layout: ArenaLayout
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., layout: _Optional[_Union[ArenaLayout, _Mapping]] = ...) -> None: ...

class RegisterArenaResponse(_message.Message):
    __slots__ = ("arena_bytes",)
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    arena_bytes: int
    def __init__(self, arena_bytes: _Optional[int] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("rid", "page_size", "new_row_le64", "new_positions_le64", "src_slots_le64", "dst_slots_le64", "freed_pages_le64", "claimed_pages_le64", "demote_slots_le64", "demote_targets_le64", "arena_claimed_le64")
    RID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NEW_ROW_LE64_FIELD_NUMBER: _ClassVar[int]
    NEW_POSITIONS_LE64_FIELD_NUMBER: _ClassVar[int]
    SRC_SLOTS_LE64_FIELD_NUMBER: _ClassVar[int]
    DST_SLOTS_LE64_FIELD_NUMBER: _ClassVar[int]
    FREED_PAGES_LE64_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_PAGES_LE64_FIELD_NUMBER: _ClassVar[int]
    DEMOTE_SLOTS_LE64_FIELD_NUMBER: _ClassVar[int]
    DEMOTE_TARGETS_LE64_FIELD_NUMBER: _ClassVar[int]
    ARENA_CLAIMED_LE64_FIELD_NUMBER: _ClassVar[int]
    rid: str
    page_size: int
    new_row_le64: bytes
    new_positions_le64: bytes
    src_slots_le64: bytes
    dst_slots_le64: bytes
    freed_pages_le64: bytes
    claimed_pages_le64: bytes
    demote_slots_le64: bytes
    demote_targets_le64: bytes
    arena_claimed_le64: bytes
    def __init__(self, rid: _Optional[str] = ..., page_size: _Optional[int] = ..., new_row_le64: _Optional[bytes] = ..., new_positions_le64: _Optional[bytes] = ..., src_slots_le64: _Optional[bytes] = ..., dst_slots_le64: _Optional[bytes] = ..., freed_pages_le64: _Optional[bytes] = ..., claimed_pages_le64: _Optional[bytes] = ..., demote_slots_le64: _Optional[bytes] = ..., demote_targets_le64: _Optional[bytes] = ..., arena_claimed_le64: _Optional[bytes] = ...) -> None: ...

class LeaseClaim(_message.Message):
    __slots__ = ("resource", "fencing_token", "holder")
    RESOURCE_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    resource: str
    fencing_token: int
    holder: str
    def __init__(self, resource: _Optional[str] = ..., fencing_token: _Optional[int] = ..., holder: _Optional[str] = ...) -> None: ...

class CompactRequest(_message.Message):
    __slots__ = ("pool_id", "epoch", "claim", "plans", "call_seq")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    PLANS_FIELD_NUMBER: _ClassVar[int]
    CALL_SEQ_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    claim: LeaseClaim
    plans: _containers.RepeatedCompositeFieldContainer[Plan]
    call_seq: int
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., claim: _Optional[_Union[LeaseClaim, _Mapping]] = ..., plans: _Optional[_Iterable[_Union[Plan, _Mapping]]] = ..., call_seq: _Optional[int] = ...) -> None: ...

class CompactResponse(_message.Message):
    __slots__ = ("slots_moved", "bytes_moved", "duration_s", "kernel", "epoch", "groups_demoted")
    SLOTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    GROUPS_DEMOTED_FIELD_NUMBER: _ClassVar[int]
    slots_moved: int
    bytes_moved: int
    duration_s: float
    kernel: str
    epoch: int
    groups_demoted: int
    def __init__(self, slots_moved: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., duration_s: _Optional[float] = ..., kernel: _Optional[str] = ..., epoch: _Optional[int] = ..., groups_demoted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("pools", "passes", "passes_rejected", "slots_moved", "bytes_moved", "kernel_seconds", "epoch_base", "pools_expired", "groups_demoted")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    PASSES_FIELD_NUMBER: _ClassVar[int]
    PASSES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    KERNEL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_BASE_FIELD_NUMBER: _ClassVar[int]
    POOLS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_DEMOTED_FIELD_NUMBER: _ClassVar[int]
    pools: int
    passes: int
    passes_rejected: int
    slots_moved: int
    bytes_moved: int
    kernel_seconds: float
    epoch_base: int
    pools_expired: int
    groups_demoted: int
    def __init__(self, pools: _Optional[int] = ..., passes: _Optional[int] = ..., passes_rejected: _Optional[int] = ..., slots_moved: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., kernel_seconds: _Optional[float] = ..., epoch_base: _Optional[int] = ..., pools_expired: _Optional[int] = ..., groups_demoted: _Optional[int] = ...) -> None: ...
