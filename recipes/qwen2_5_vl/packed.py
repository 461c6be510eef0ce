"""Packed and padded model kwargs for Qwen2.5-VL (transformers 5.24).

How Qwen2.5-VL consumes positions and media (``modeling_qwen2_5_vl.py``):

- ``Qwen2_5_VLModel.get_rope_index(input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw,
  second_per_grid_ts)`` walks each row as ONE sequence like Qwen2-VL's (text advances by 1; a media run starting at
  ``p`` takes height ``p + i`` and width ``p + j`` and moves ``p`` on by ``max(h, w) / merge``), except that a clip's
  temporal row is ``p + int(t * tokens_per_second * second_per_grid_ts)``: the seconds each temporal patch spans,
  consumed in order across rows with the video grids. Left out, it is 1 for every clip (no error: positions as if
  every clip ran at ``temporal_patch_size`` frames a second). The encoder writes it per clip
  (``recipes/qwen2_5_vl/encoder.py``), the DataKit merges it per pack in clip order (a per-item field of videos),
  and ``mvp_engine.packing.segment_rope`` hands each segment's call that segment's own grids and seconds, which is
  what the sample alone gets; the padded baseline passes it to the model's forward.
- ``Qwen2_5_VLTextModel.forward``: (4, B, L) ``position_ids`` split into the text row ``[0]`` (packed detection,
  flash's varlen fallback) and the rotary rows ``[1:]``, as in Qwen2-VL.
- The vision tower: windowed attention in every block outside ``fullatt_block_indexes``. ``get_window_index``
  reorders each item's merged patches into windows of ``window_size / patch_size / merge`` merged tokens a side
  (the edges padded per item) and builds ``cu_window_seqlens`` from the grids; full blocks use the per-frame
  ``cu_seqlens``. Both come from ``image_grid_thw`` / ``video_grid_thw`` item by item, so a pack's concatenated
  media (in segment order, ``mvp_engine.packing.inputs.media_owners``) gives every item the windows it gets alone;
  the language model's varlen kwargs never reach the tower.

Attention: eager/sdpa get an explicit 4-D block-causal mask from ``pack_segment_ids``; flash_attention_2 and
sdpa_varlen get ``cu_seq_lens_q/k`` + ``max_length_q/k`` and no ``attention_mask``. flex_attention is not offered:
transformers 5.24 refuses it for Qwen2.5-VL at load time. The kwargs are the Qwen families' shared
``recipes.qwen.packed``.
"""

from __future__ import annotations

from functools import partial

from recipes.qwen import packed as qwen_packed

# flex_attention is refused by transformers 5.24 for Qwen2.5-VL at load time.
ATTENTION_BACKENDS = ("eager", "sdpa", "sdpa_varlen", "flash_attention_2")

__all__ = ["ATTENTION_BACKENDS", "prepare_packed", "prepare_padded"]

prepare_packed = partial(qwen_packed.prepare_packed, supported=ATTENTION_BACKENDS)
prepare_padded = qwen_packed.prepare_padded
