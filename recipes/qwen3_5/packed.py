"""Packed and padded model kwargs for Qwen3.5 (transformers 5.24): a hybrid model, so two kinds of boundaries.

- Full-attention layers: as every recipe, from ``pack_segment_ids`` (``mvp_engine.packing.inputs``): a 4-D
  block-causal mask on eager/sdpa, ``cu_seq_lens_q/k`` + ``max_length_q/k`` on sdpa_varlen and flash.
- Gated DeltaNet linear-attention layers: ``cu_seq_lens_q`` over the flattened batch (the model hands it to them as
  ``cu_seqlens``), given by ``prepare_packed_inputs`` next to the mask on eager/sdpa, and honoured by the
  boundary-aware conv1d and gated delta rule that ``build_model`` installs (``mvp_engine.packing.linear_attention``:
  what transformers does with them and the measured leak). The guard there refuses a packed forward without them.
- Positions: Qwen3.5's ``get_rope_index`` has Qwen3-VL's signature (a clip split into one frame per run,
  interleaved rotary sections), driven per segment by ``mvp_engine.packing.segment_rope`` (the Qwen families' shared
  ``recipes.qwen.packed``): (4, B, L), text row first.

flex_attention is not offered: transformers 5.24 does not declare it for Qwen3.5. flash_attention_2 runs the full
attention layers on the flash kernel; the linear ones then run the torch reference per sample (exact, unverified on
a GPU here).
"""

from __future__ import annotations

from functools import partial

from recipes.qwen import packed as qwen_packed

# flex_attention is not declared by transformers 5.24 for Qwen3.5.
ATTENTION_BACKENDS = ("eager", "sdpa", "sdpa_varlen", "flash_attention_2")

__all__ = ["ATTENTION_BACKENDS", "prepare_packed", "prepare_padded"]

prepare_packed = partial(qwen_packed.prepare_packed, supported=ATTENTION_BACKENDS)
prepare_padded = qwen_packed.prepare_padded
