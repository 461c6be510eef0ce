"""Packed and padded model kwargs for Qwen2-VL (transformers 5.24).

How Qwen2-VL consumes positions (``modeling_qwen2_vl.py``):

- ``Qwen2VLModel.forward`` computes M-RoPE itself (``compute_3d_position_ids`` -> ``get_rope_index``) only when
  ``position_ids`` is None; ``get_rope_index(input_ids, mm_token_type_ids, image_grid_thw, ...)`` walks each row as
  ONE sequence (text runs advance by 1, an image block takes a (t, h, w) grid starting at the current position,
  after it the position advances by ``max(h, w) / merge``) and consumes ``image_grid_thw`` in order across rows.
  Run on a packed row it would continue positions across samples, so ``mvp_engine.packing.segment_rope`` calls it per
  segment with that segment's own image and video grids (``video_grid_thw`` is consumed in order too; a clip is
  one run of video tokens whose temporal positions advance by 1 per temporal patch in Qwen2-VL).
- ``Qwen2VLTextModel.forward``: (4, B, L) ``position_ids`` are split into a text row ``[0]`` and the M-RoPE rows
  ``[1:]``. Only the text row goes to ``create_causal_mask`` (packed detection) and to the attention function
  (flash's position-based varlen fallback); 2-D or (3, B, L) positions give ``text_position_ids=None``, i.e. no
  packed handling at all. The rotary embedding uses rows 1..3 only.

Attention choice for eager/sdpa: an explicit 4-D block-causal mask from ``pack_segment_ids`` (``create_causal_mask``
returns a 4-D mask untouched). Transformers' own detection from the text row gives the same logits (proved by
``test_transformers_packed_detection_is_equivalent`` in ``tests/test_packed_equivalence.py``), but it infers
boundaries from position steps and silently switches off when a cache or any 2-D mask is present; the explicit
mask follows the segment ids (the DataKit's truth) and costs the same (transformers materialises the same
(B, 1, L, L) mask when it detects packing).
Flash attention gets ``cu_seq_lens_q/k`` + ``max_length_q/k`` and no ``attention_mask``. flex_attention is not
offered: transformers 5.24 refuses it for Qwen2-VL at load time.

The kwargs themselves (modality map, media, per-segment M-RoPE) are the Qwen families' shared ``recipes.qwen.packed``
over the generic ``mvp_engine.packing.segment_rope``; masks, guards and media order are ``mvp_engine.packing.inputs``.
"""

from __future__ import annotations

from functools import partial

from recipes.qwen import packed as qwen_packed

# flex_attention is refused by transformers 5.24 for Qwen2-VL at load time.
ATTENTION_BACKENDS = ("eager", "sdpa", "sdpa_varlen", "flash_attention_2")

__all__ = ["ATTENTION_BACKENDS", "prepare_packed", "prepare_padded"]

prepare_packed = partial(qwen_packed.prepare_packed, supported=ATTENTION_BACKENDS)
prepare_padded = qwen_packed.prepare_padded
