"""Packed and padded model kwargs for Qwen3-VL (transformers 5.24).

How Qwen3-VL consumes positions and media (``modeling_qwen3_vl.py``):

- ``Qwen3VLModel.forward`` computes M-RoPE itself (``compute_3d_position_ids`` -> ``get_rope_index``) only when
  ``position_ids`` is None. ``get_rope_index(input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw)`` first
  splits every video's grid ``(t, h, w)`` into ``t`` grids ``(1, h, w)``: in the text a clip is one
  ``<|vision_start|><|video_pad|>...<|vision_end|>`` run per temporal patch, each after its ``<t seconds>``
  timestamp (``recipes/qwen/encoder.py``), and each run consumes one of those grids. It then walks the row as ONE
  sequence: text advances by 1; a run starting at position ``p`` gets temporal ``p``, height ``p + i``, width
  ``p + j`` (so the temporal row carries no time: the timestamps, plain text between the runs, do) and moves ``p``
  on by ``max(h, w) / merge``. Grids are consumed in order across rows, so on a packed row positions would run on
  from one sample into the next: ``mvp_engine.packing.segment_rope`` calls it per segment with that segment's own
  image and video grids (the frames of a clip never straddle segments: a clip is never cut), which is what the
  sample alone gets.
- ``Qwen3VLTextModel.forward``: (4, B, L) ``position_ids`` are split into a text row ``[0]`` and the M-RoPE rows
  ``[1:]``. Only the text row reaches ``create_causal_mask`` and the attention function; 2-D or (3, B, L) positions
  give ``text_position_ids=None``: no packed handling at all. The rotary embedding reads rows 1..3 *interleaved*
  (``mrope_interleaved``: frequency ``i`` takes height when ``i % 3 == 1`` within the height section, width when
  ``i % 3 == 2`` within the width section, temporal otherwise) instead of Qwen2-VL's contiguous sections; the
  positions are the same kind of (3, B, L) rows either way.
- DeepStack: the vision tower also returns merged features of the layers in ``deepstack_visual_indexes``; the model
  scatters the final features into the ``<|image_pad|>`` / ``<|video_pad|>`` tokens (``masked_scatter`` in
  flattened row-major order), forms ``visual_pos_masks`` = image | video placeholders over (B, L) and adds the k-th
  DeepStack features to ``hidden_states[visual_pos_masks]`` after decoder layer k, images' and videos' joined by
  those masks. In a packed batch the DataKit concatenates each kind's media in row-major, segment order
  (``mvp_engine.packing.inputs.media_owners`` refuses any other order, ``check_media_placement`` checks every
  segment's placeholder count against its own grids), which is the order of the placeholders in the flattened
  batch, so every feature, final and DeepStack, lands on its own sample's tokens; the addition is per token, so it
  is the same packed as alone (``tests/test_packed_equivalence.py``: a pack with a clip, images and text samples).
- The vision tower derives its own ``cu_seqlens`` from the grids (attention within one frame of one item); the
  language model's varlen kwargs never reach it (it runs sdpa under ``sdpa_varlen``, flash under flash).

Attention: eager/sdpa get an explicit 4-D block-causal mask from ``pack_segment_ids``; flash_attention_2 and
sdpa_varlen get ``cu_seq_lens_q/k`` + ``max_length_q/k`` and no ``attention_mask``. flex_attention is not offered:
transformers 5.24 refuses it for Qwen3-VL at load time. The kwargs are the Qwen families' shared
``recipes.qwen.packed``; masks, guards and media order are ``mvp_engine.packing.inputs``.
"""

from __future__ import annotations

from functools import partial

from recipes.qwen import packed as qwen_packed
from recipes.qwen.qwen3_vl import QWEN3_VL_ATTENTION_BACKENDS as ATTENTION_BACKENDS  # flex refused at load time

__all__ = ["ATTENTION_BACKENDS", "prepare_packed", "prepare_padded"]

prepare_packed = partial(qwen_packed.prepare_packed, supported=ATTENTION_BACKENDS)
prepare_padded = qwen_packed.prepare_padded
