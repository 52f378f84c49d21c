from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CaptionLength(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CAPTION_LENGTH_UNSPECIFIED: _ClassVar[CaptionLength]
    CAPTION_LENGTH_SHORT: _ClassVar[CaptionLength]
    CAPTION_LENGTH_NORMAL: _ClassVar[CaptionLength]
    CAPTION_LENGTH_LONG: _ClassVar[CaptionLength]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_MAX_OBJECTS: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
CAPTION_LENGTH_UNSPECIFIED: CaptionLength
CAPTION_LENGTH_SHORT: CaptionLength
CAPTION_LENGTH_NORMAL: CaptionLength
CAPTION_LENGTH_LONG: CaptionLength
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_MAX_OBJECTS: FinishReason
FINISH_REASON_CANCELLED: FinishReason

class GenerationSettings(_message.Message):
    __slots__ = ("temperature", "top_p", "max_tokens", "max_objects", "seed", "adapter", "clip", "priority")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    CLIP_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    max_tokens: int
    max_objects: int
    seed: int
    adapter: str
    clip: bool
    priority: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., max_tokens: _Optional[int] = ..., max_objects: _Optional[int] = ..., seed: _Optional[int] = ..., adapter: _Optional[str] = ..., clip: _Optional[bool] = ..., priority: _Optional[int] = ...) -> None: ...

class SpatialRef(_message.Message):
    __slots__ = ("point", "box")
    POINT_FIELD_NUMBER: _ClassVar[int]
    BOX_FIELD_NUMBER: _ClassVar[int]
    point: NormalizedPoint
    box: NormalizedBox
    def __init__(self, point: _Optional[_Union[NormalizedPoint, _Mapping]] = ..., box: _Optional[_Union[NormalizedBox, _Mapping]] = ...) -> None: ...

class RequestMetrics(_message.Message):
    __slots__ = ("queue_wait_ms", "time_to_first_token_ms", "prefill_ms", "decode_ms", "total_ms", "input_tokens", "output_tokens", "cached_tokens", "intake_ms", "prefix_wait_ms", "reasoning_tokens")
    QUEUE_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INTAKE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    queue_wait_ms: float
    time_to_first_token_ms: float
    prefill_ms: float
    decode_ms: float
    total_ms: float
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    intake_ms: float
    prefix_wait_ms: float
    reasoning_tokens: int
    def __init__(self, queue_wait_ms: _Optional[float] = ..., time_to_first_token_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., input_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., intake_ms: _Optional[float] = ..., prefix_wait_ms: _Optional[float] = ..., reasoning_tokens: _Optional[int] = ...) -> None: ...

class NormalizedPoint(_message.Message):
    __slots__ = ("x_norm", "y_norm")
    X_NORM_FIELD_NUMBER: _ClassVar[int]
    Y_NORM_FIELD_NUMBER: _ClassVar[int]
    x_norm: float
    y_norm: float
    def __init__(self, x_norm: _Optional[float] = ..., y_norm: _Optional[float] = ...) -> None: ...

class NormalizedBox(_message.Message):
    __slots__ = ("x_min_norm", "y_min_norm", "x_max_norm", "y_max_norm")
    X_MIN_NORM_FIELD_NUMBER: _ClassVar[int]
    Y_MIN_NORM_FIELD_NUMBER: _ClassVar[int]
    X_MAX_NORM_FIELD_NUMBER: _ClassVar[int]
    Y_MAX_NORM_FIELD_NUMBER: _ClassVar[int]
    x_min_norm: float
    y_min_norm: float
    x_max_norm: float
    y_max_norm: float
    def __init__(self, x_min_norm: _Optional[float] = ..., y_min_norm: _Optional[float] = ..., x_max_norm: _Optional[float] = ..., y_max_norm: _Optional[float] = ...) -> None: ...

class CaptionRequest(_message.Message):
    __slots__ = ("image_bytes", "image_id", "length", "settings")
    IMAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    image_bytes: bytes
    image_id: str
    length: CaptionLength
    settings: GenerationSettings
    def __init__(self, image_bytes: _Optional[bytes] = ..., image_id: _Optional[str] = ..., length: _Optional[_Union[CaptionLength, str]] = ..., settings: _Optional[_Union[GenerationSettings, _Mapping]] = ...) -> None: ...

class TextDelta(_message.Message):
    __slots__ = ("text", "reasoning")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    text: str
    reasoning: bool
    def __init__(self, text: _Optional[str] = ..., reasoning: _Optional[bool] = ...) -> None: ...

class GroundedSpan(_message.Message):
    __slots__ = ("start_idx", "end_idx", "points")
    START_IDX_FIELD_NUMBER: _ClassVar[int]
    END_IDX_FIELD_NUMBER: _ClassVar[int]
    POINTS_FIELD_NUMBER: _ClassVar[int]
    start_idx: int
    end_idx: int
    points: _containers.RepeatedCompositeFieldContainer[NormalizedPoint]
    def __init__(self, start_idx: _Optional[int] = ..., end_idx: _Optional[int] = ..., points: _Optional[_Iterable[_Union[NormalizedPoint, _Mapping]]] = ...) -> None: ...

class Reasoning(_message.Message):
    __slots__ = ("text", "grounding")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    GROUNDING_FIELD_NUMBER: _ClassVar[int]
    text: str
    grounding: _containers.RepeatedCompositeFieldContainer[GroundedSpan]
    def __init__(self, text: _Optional[str] = ..., grounding: _Optional[_Iterable[_Union[GroundedSpan, _Mapping]]] = ...) -> None: ...

class TextResult(_message.Message):
    __slots__ = ("text", "finish_reason", "metrics", "reasoning")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    text: str
    finish_reason: FinishReason
    metrics: RequestMetrics
    reasoning: Reasoning
    def __init__(self, text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., metrics: _Optional[_Union[RequestMetrics, _Mapping]] = ..., reasoning: _Optional[_Union[Reasoning, _Mapping]] = ...) -> None: ...

class CaptionResponse(_message.Message):
    __slots__ = ("delta", "result")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    delta: TextDelta
    result: TextResult
    def __init__(self, delta: _Optional[_Union[TextDelta, _Mapping]] = ..., result: _Optional[_Union[TextResult, _Mapping]] = ...) -> None: ...

class QueryRequest(_message.Message):
    __slots__ = ("image_bytes", "image_id", "question", "choices", "regex", "settings", "reasoning", "spatial_refs")
    IMAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_ID_FIELD_NUMBER: _ClassVar[int]
    QUESTION_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    SPATIAL_REFS_FIELD_NUMBER: _ClassVar[int]
    image_bytes: bytes
    image_id: str
    question: str
    choices: _containers.RepeatedScalarFieldContainer[str]
    regex: str
    settings: GenerationSettings
    reasoning: bool
    spatial_refs: _containers.RepeatedCompositeFieldContainer[SpatialRef]
    def __init__(self, image_bytes: _Optional[bytes] = ..., image_id: _Optional[str] = ..., question: _Optional[str] = ..., choices: _Optional[_Iterable[str]] = ..., regex: _Optional[str] = ..., settings: _Optional[_Union[GenerationSettings, _Mapping]] = ..., reasoning: _Optional[bool] = ..., spatial_refs: _Optional[_Iterable[_Union[SpatialRef, _Mapping]]] = ...) -> None: ...

class QueryResponse(_message.Message):
    __slots__ = ("delta", "result")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    delta: TextDelta
    result: TextResult
    def __init__(self, delta: _Optional[_Union[TextDelta, _Mapping]] = ..., result: _Optional[_Union[TextResult, _Mapping]] = ...) -> None: ...

class PointRequest(_message.Message):
    __slots__ = ("image_bytes", "image_id", "object", "settings", "spatial_refs")
    IMAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_ID_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    SPATIAL_REFS_FIELD_NUMBER: _ClassVar[int]
    image_bytes: bytes
    image_id: str
    object: str
    settings: GenerationSettings
    spatial_refs: _containers.RepeatedCompositeFieldContainer[SpatialRef]
    def __init__(self, image_bytes: _Optional[bytes] = ..., image_id: _Optional[str] = ..., object: _Optional[str] = ..., settings: _Optional[_Union[GenerationSettings, _Mapping]] = ..., spatial_refs: _Optional[_Iterable[_Union[SpatialRef, _Mapping]]] = ...) -> None: ...

class PointResponse(_message.Message):
    __slots__ = ("points", "finish_reason", "metrics")
    POINTS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    points: _containers.RepeatedCompositeFieldContainer[NormalizedPoint]
    finish_reason: FinishReason
    metrics: RequestMetrics
    def __init__(self, points: _Optional[_Iterable[_Union[NormalizedPoint, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., metrics: _Optional[_Union[RequestMetrics, _Mapping]] = ...) -> None: ...

class DetectRequest(_message.Message):
    __slots__ = ("image_bytes", "image_id", "object", "settings", "spatial_refs")
    IMAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_ID_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    SPATIAL_REFS_FIELD_NUMBER: _ClassVar[int]
    image_bytes: bytes
    image_id: str
    object: str
    settings: GenerationSettings
    spatial_refs: _containers.RepeatedCompositeFieldContainer[SpatialRef]
    def __init__(self, image_bytes: _Optional[bytes] = ..., image_id: _Optional[str] = ..., object: _Optional[str] = ..., settings: _Optional[_Union[GenerationSettings, _Mapping]] = ..., spatial_refs: _Optional[_Iterable[_Union[SpatialRef, _Mapping]]] = ...) -> None: ...

class DetectResponse(_message.Message):
    __slots__ = ("boxes", "finish_reason", "metrics")
    BOXES_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    boxes: _containers.RepeatedCompositeFieldContainer[NormalizedBox]
    finish_reason: FinishReason
    metrics: RequestMetrics
    def __init__(self, boxes: _Optional[_Iterable[_Union[NormalizedBox, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., metrics: _Optional[_Union[RequestMetrics, _Mapping]] = ...) -> None: ...

class SegmentRequest(_message.Message):
    __slots__ = ("image_bytes", "image_id", "object", "settings", "spatial_refs")
    IMAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_ID_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    SPATIAL_REFS_FIELD_NUMBER: _ClassVar[int]
    image_bytes: bytes
    image_id: str
    object: str
    settings: GenerationSettings
    spatial_refs: _containers.RepeatedCompositeFieldContainer[SpatialRef]
    def __init__(self, image_bytes: _Optional[bytes] = ..., image_id: _Optional[str] = ..., object: _Optional[str] = ..., settings: _Optional[_Union[GenerationSettings, _Mapping]] = ..., spatial_refs: _Optional[_Iterable[_Union[SpatialRef, _Mapping]]] = ...) -> None: ...

class Polygon(_message.Message):
    __slots__ = ("points",)
    POINTS_FIELD_NUMBER: _ClassVar[int]
    points: _containers.RepeatedCompositeFieldContainer[NormalizedPoint]
    def __init__(self, points: _Optional[_Iterable[_Union[NormalizedPoint, _Mapping]]] = ...) -> None: ...

class RleMask(_message.Message):
    __slots__ = ("counts", "height", "width")
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    height: int
    width: int
    def __init__(self, counts: _Optional[_Iterable[int]] = ..., height: _Optional[int] = ..., width: _Optional[int] = ...) -> None: ...

class SegmentResponse(_message.Message):
    __slots__ = ("box", "svg_path", "polygons", "mask", "finish_reason", "metrics")
    BOX_FIELD_NUMBER: _ClassVar[int]
    SVG_PATH_FIELD_NUMBER: _ClassVar[int]
    POLYGONS_FIELD_NUMBER: _ClassVar[int]
    MASK_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    box: NormalizedBox
    svg_path: str
    polygons: _containers.RepeatedCompositeFieldContainer[Polygon]
    mask: RleMask
    finish_reason: FinishReason
    metrics: RequestMetrics
    def __init__(self, box: _Optional[_Union[NormalizedBox, _Mapping]] = ..., svg_path: _Optional[str] = ..., polygons: _Optional[_Iterable[_Union[Polygon, _Mapping]]] = ..., mask: _Optional[_Union[RleMask, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., metrics: _Optional[_Union[RequestMetrics, _Mapping]] = ...) -> None: ...

class EncodeImageRequest(_message.Message):
    __slots__ = ("image_bytes",)
    IMAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    image_bytes: bytes
    def __init__(self, image_bytes: _Optional[bytes] = ...) -> None: ...

class EncodeImageResponse(_message.Message):
    __slots__ = ("image_id", "width", "height", "num_crops", "already_cached")
    IMAGE_ID_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_CROPS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_CACHED_FIELD_NUMBER: _ClassVar[int]
    image_id: str
    width: int
    height: int
    num_crops: int
    already_cached: bool
    def __init__(self, image_id: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., num_crops: _Optional[int] = ..., already_cached: _Optional[bool] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerLimits(_message.Message):
    __slots__ = ("max_message_bytes", "max_image_bytes", "max_image_pixels", "max_image_side", "max_tokens", "max_queue", "image_cache_bytes", "max_object_chars", "max_question_chars", "max_choices", "max_choice_chars", "max_regex_chars", "max_spatial_refs", "max_adapters", "max_adapter_rank")
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_SIDE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_OBJECT_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUESTION_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHOICES_FIELD_NUMBER: _ClassVar[int]
    MAX_CHOICE_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_REGEX_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_SPATIAL_REFS_FIELD_NUMBER: _ClassVar[int]
    MAX_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_ADAPTER_RANK_FIELD_NUMBER: _ClassVar[int]
    max_message_bytes: int
    max_image_bytes: int
    max_image_pixels: int
    max_image_side: int
    max_tokens: int
    max_queue: int
    image_cache_bytes: int
    max_object_chars: int
    max_question_chars: int
    max_choices: int
    max_choice_chars: int
    max_regex_chars: int
    max_spatial_refs: int
    max_adapters: int
    max_adapter_rank: int
    def __init__(self, max_message_bytes: _Optional[int] = ..., max_image_bytes: _Optional[int] = ..., max_image_pixels: _Optional[int] = ..., max_image_side: _Optional[int] = ..., max_tokens: _Optional[int] = ..., max_queue: _Optional[int] = ..., image_cache_bytes: _Optional[int] = ..., max_object_chars: _Optional[int] = ..., max_question_chars: _Optional[int] = ..., max_choices: _Optional[int] = ..., max_choice_chars: _Optional[int] = ..., max_regex_chars: _Optional[int] = ..., max_spatial_refs: _Optional[int] = ..., max_adapters: _Optional[int] = ..., max_adapter_rank: _Optional[int] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("id", "rank", "resident")
    ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    id: str
    rank: int
    resident: bool
    def __init__(self, id: _Optional[str] = ..., rank: _Optional[int] = ..., resident: _Optional[bool] = ...) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model_name", "preset", "token_contract", "device", "dtype", "max_context", "pipeline_depth", "max_batch_size", "limits", "server_version", "max_step_tokens", "adapters")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    PRESET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CONTRACT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    preset: str
    token_contract: str
    device: str
    dtype: str
    max_context: int
    pipeline_depth: int
    max_batch_size: int
    limits: ServerLimits
    server_version: str
    max_step_tokens: int
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    def __init__(self, model_name: _Optional[str] = ..., preset: _Optional[str] = ..., token_contract: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., max_context: _Optional[int] = ..., pipeline_depth: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., limits: _Optional[_Union[ServerLimits, _Mapping]] = ..., server_version: _Optional[str] = ..., max_step_tokens: _Optional[int] = ..., adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ...) -> None: ...
