"""What the Qwen vision-language recipes share (``recipes/qwen2_vl``, ``recipes/qwen2_5_vl``, ``recipes/qwen3_vl``,
``recipes/qwen3_vl_moe``, ``recipes/qwen3_5``, ``recipes/qwen3_5_moe``): a family package, not a recipe (no entry
point, no config), written once and imported by each. What a grid-patch vision tower needs whatever the family
(GLM-4.1V's tower is Qwen2-VL's) is generic: the kit's ``GridPatchVideoProcessor``, the engine's ``grid_vision``
and ``builders.grid_video_processor``, the packing layer's ``grid_media``.

- ``tokens``: the special tokens (ChatML turns, ``<|image_pad|>`` / ``<|video_pad|>`` inside
  ``<|vision_start|>...<|vision_end|>``), the chat templates and the tokenizers (``TOKENIZERS``: the assets of
  qwen2_vl, qwen2_5_vl, qwen3_vl and qwen3_5; InternVL's is built on :func:`tokens.qwen2_bpe_tokenizer` too).
- ``video``: :class:`QwenVideoProcessor` (Qwen2-VL) and :class:`Qwen3VideoProcessor` (Qwen3-VL, Qwen3.5): frame
  sampling, sizes and timestamps on the kit's grid-patch layout.
- ``processor``: :class:`QwenProcessorBundle` / :func:`build_qwen_processor` (tokenizer, image and video processors).
- ``qwen3_vl``: what the recipes over Qwen3-VL checkpoints share (``recipes/qwen3_vl``, ``recipes/qwen3_vl_moe``): the
  tokenizer asset, image and video processing (:func:`qwen3_vl.build_qwen3_vl_processor`), the attention backends.
- ``model``: :func:`build_qwen_model` (pretrained or a tiny seeded init wired to the tokenizer's special tokens),
  :data:`qwen_cost_profile` (where the cost model finds the vision tower and merger).
- ``hybrid``: :func:`build_hybrid_model` (Qwen3.5 and Qwen3.5-MoE: Gated DeltaNet layers made boundary-aware).
- ``encoder``: :class:`QwenSampleEncoder` (ChatML, Qwen2-VL's video text) and :class:`Qwen3SampleEncoder`
  (Qwen3-VL's timestamped frame runs).
- ``packed``: ``prepare_packed`` / ``prepare_padded`` with per-segment M-RoPE, which each recipe binds to its own
  attention backends.
"""

from .encoder import Qwen3SampleEncoder, QwenSampleEncoder
from .hybrid import build_hybrid_model
from .model import build_qwen_model, qwen_cost_profile, qwen_tiny_config
from .packed import mm_token_type_ids, packed_position_ids, prepare_packed, prepare_padded
from .processor import QwenProcessorBundle, build_qwen_processor
from .video import Qwen3VideoProcessor, QwenVideoProcessor

__all__ = [
    "Qwen3SampleEncoder",
    "Qwen3VideoProcessor",
    "QwenProcessorBundle",
    "QwenSampleEncoder",
    "QwenVideoProcessor",
    "build_hybrid_model",
    "build_qwen_model",
    "build_qwen_processor",
    "mm_token_type_ids",
    "packed_position_ids",
    "prepare_packed",
    "prepare_padded",
    "qwen_cost_profile",
    "qwen_tiny_config",
]
