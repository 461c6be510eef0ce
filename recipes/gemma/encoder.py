"""The sample encoder Gemma 3 and Gemma 4 share: Gemma's chat template, its image layout and its token types.

Per Gemma's processors, an image part (the template's ``<start_of_image>``) becomes ``\\n\\n<start_of_image>``, the
image's soft tokens, ``<end_of_image>\\n\\n``; the soft tokens are the placeholders the model fills and the ones its
token types mark (1), the bidirectional block of each image. Only the model's turns are supervised: their content
and the closing ``<end_of_turn>``, never ``<start_of_turn>model\\n``, the image tokens or the line break after the
turn. A family member sets its token-type field (``token_type_ids`` for Gemma 3, ``mm_token_type_ids`` for Gemma 4)
and its image tokens, and implements the image hooks.
"""

from __future__ import annotations

from mvp_engine.kit.mllm.data.chat import ChatTemplateEncoder

from .tokens import BOI_TOKEN, END_OF_TURN, EOI_TOKEN, IMAGE_SOFT_TOKEN, START_OF_TURN


class GemmaSampleEncoder(ChatTemplateEncoder):
    """``ChatTemplateEncoder`` with Gemma's turns and image layout; subclasses add the image hooks."""

    image_token = IMAGE_SOFT_TOKEN
    image_part = BOI_TOKEN
    boi_token = BOI_TOKEN
    eoi_token = EOI_TOKEN
    assistant_header = f"{START_OF_TURN}model\n"
    turn_end = END_OF_TURN
    unsupervised_tokens = (BOI_TOKEN, EOI_TOKEN)
    token_type_field = "token_type_ids"

    def image_text(self, tokens: int) -> str:
        return f"\n\n{self.boi_token}{self.image_token * tokens}{self.eoi_token}\n\n"
