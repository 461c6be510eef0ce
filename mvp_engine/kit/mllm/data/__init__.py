"""The generic, model-free DataKit: records -> samples -> packs -> batches, with honest accounting."""

from .accounting import RecordLedger, SourceTally, TokenAccounting, token_shares
from .assembler import (
    BestFitDecreasingAssembler,
    GreedyAssembler,
    MLLMPackingAssembler,
    OverlongSampleError,
    SingleSampleAssembler,
)
from .bad_records import BadRecord, BadRecordReport, TooManyBadRecords
from .balance import StepLayout, balance_rng, balanced_order, imbalance_summary
from .chat import ChatTemplateEncoder, FixedImageTokens
from .check import decode_faults, find_bad_records
from .collator import MLLMCollator
from .cost import CostProfile, Rate, WorkUnits, pack_costs
from .dataset import EpochPlan, MLLMDataKit, MLLMPackedDataset, MLLMStreamingPackedDataset
from .images import load_image, read_image_size
from .media import MEDIA_KINDS, MediaKind, MLLMMediaHandler
from .mixture import MLLMSource, epoch_draw, source_entries
from .pack import MLLMPack
from .sample import IGNORE_INDEX, MLLMRecord, MLLMSample, MLLMSampleEncoder, SampleMeta
from .sources import MLLMRecordError, read_records
from .spec import MLLMDataSpec, MLLMPackingSpec
from .steps import estimate_total_steps, micro_batches_per_rank, optimizer_steps, packs_per_rank
from .store import RecordStore, source_identity, source_kind
from .stream import MLLMStreamDataset, StreamPlanner, stream_packing_problem
from .stream_sources import IterableStream, RecordStream, ShardStream
from .video import VideoInfo, load_video_frames, read_video_info
from .video_patches import normalize_frames, patchify

__all__ = [
    "BadRecord",
    "BadRecordReport",
    "RecordLedger",
    "TooManyBadRecords",
    "IGNORE_INDEX",
    "BestFitDecreasingAssembler",
    "ChatTemplateEncoder",
    "FixedImageTokens",
    "CostProfile",
    "EpochPlan",
    "GreedyAssembler",
    "MLLMCollator",
    "MLLMDataKit",
    "MEDIA_KINDS",
    "MLLMDataSpec",
    "MLLMMediaHandler",
    "MLLMPack",
    "MLLMPackedDataset",
    "MLLMPackingAssembler",
    "MLLMPackingSpec",
    "MLLMRecord",
    "MLLMRecordError",
    "MLLMSample",
    "MLLMSource",
    "MLLMSampleEncoder",
    "MLLMStreamDataset",
    "MLLMStreamingPackedDataset",
    "IterableStream",
    "RecordStream",
    "ShardStream",
    "StreamPlanner",
    "stream_packing_problem",
    "OverlongSampleError",
    "RecordStore",
    "MediaKind",
    "Rate",
    "SampleMeta",
    "SingleSampleAssembler",
    "SourceTally",
    "StepLayout",
    "TokenAccounting",
    "VideoInfo",
    "WorkUnits",
    "balance_rng",
    "balanced_order",
    "decode_faults",
    "epoch_draw",
    "estimate_total_steps",
    "find_bad_records",
    "imbalance_summary",
    "load_image",
    "load_video_frames",
    "micro_batches_per_rank",
    "normalize_frames",
    "optimizer_steps",
    "pack_costs",
    "packs_per_rank",
    "patchify",
    "read_image_size",
    "read_records",
    "read_video_info",
    "source_entries",
    "source_identity",
    "source_kind",
    "token_shares",
]
