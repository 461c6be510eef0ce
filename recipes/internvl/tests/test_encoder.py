"""The InternVL encoder and artifacts (the kit's ``EncoderSuite``: measure == encode, assistant-only labels, errors
naming the record, save/load round trip, a reproducible tokenizer asset, no torchvision), plus the comparison with
transformers' own ``InternVLProcessor`` on the same conversations: the same ids and tiles, and the same per-image
tile and token counts from the image sizes alone."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import InternVLProcessor
from transformers.processing_utils import ProcessorMixin

from mvp_engine.engine.testing import compose_config, demo_like_records, load_recipe
from mvp_engine.engine.testkit.suites import EncoderSuite
from mvp_engine.kit.mllm.data.images import load_image

TILE_TOKENS = 16  # (56 / 7)^2 patches, pixel shuffle 0.5


@pytest.fixture
def transformers_processor(encoder, monkeypatch):
    """``InternVLProcessor`` over the encoder's tokenizer and image processor. Its class check looks the video
    processor up in a registry that is a placeholder without torchvision (an AttributeError), so it is skipped: the
    arguments are the classes it expects, and no video goes through it."""
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
    return InternVLProcessor(image_processor=encoder.image_processor, tokenizer=encoder.tokenizer,
                             image_seq_length=encoder.tokens_per_tile, chat_template=encoder.tokenizer.chat_template)


class TestEncoder(EncoderSuite):
    recipe = "internvl"

    def test_every_image_is_its_tiles_context_tokens_between_img_and_end_img(self, encoder, tmp_path):
        """The fixture's wide (90x60) and tall (50x120) images tile 2x1 and 1x2 (+ a thumbnail), the square and
        the small one are one tile; the tiles are stacked in image order and ``image_num_patches`` counts them."""
        tiles = {"img0": [3], "txt0": [], "multi": [1, 3, 1], "txt1": [], "img1": [1]}
        for record in demo_like_records(tmp_path):
            sample = encoder.encode(record)
            counts = sample.media.get("image_num_patches", torch.zeros(0, dtype=torch.long)).tolist()
            assert counts == tiles[record.record_id], record.record_id
            assert sample.num_media == len(counts) and sample.media_tokens == TILE_TOKENS * sum(counts)
            text = encoder.tokenizer.decode(sample.input_ids)
            for n in counts:
                assert f"<img>{'<IMG_CONTEXT>' * (TILE_TOKENS * n)}</img>" in text
            assert text.count("<img>") == text.count("</img>") == len(counts)
            if counts:
                assert tuple(sample.media["pixel_values"].shape) == (sum(counts), 3, 56, 56)

    def test_encoding_equals_transformers_internvl_processor(self, encoder, transformers_processor, tmp_path):
        """On the chat template's text of each record (one wide image, three images over two turns, text-only with
        and without a system turn): identical ``input_ids`` and stacked tiles, and ``measure``'s per-image token
        counts equal the processor's own from the image sizes (``_get_num_multimodal_tokens``: 2 + tiles x 16)."""
        records = demo_like_records(tmp_path)
        assert {len(r.image_paths) for r in records} == {0, 1, 3}
        for record in records:
            ours = encoder.encode(record)
            images = [load_image(path) for path in record.image_paths]
            text = transformers_processor.apply_chat_template(record.messages, tokenize=False)
            theirs = transformers_processor(text=[text], images=images or None, return_tensors="pt")
            assert torch.equal(theirs["input_ids"][0], ours.input_ids), record.origin
            if not images:
                assert "pixel_values" not in theirs and not ours.media
                continue
            assert torch.equal(theirs["pixel_values"], ours.media["pixel_values"]), record.origin
            sizes = [(image.height, image.width) for image in images]
            counted = transformers_processor._get_num_multimodal_tokens(image_sizes=sizes)
            assert counted["num_image_patches"] == ours.media["image_num_patches"].tolist()
            assert sum(counted["num_image_tokens"]) == encoder.measure(record).media_tokens + 2 * len(images)

    def test_a_pretrained_folder_saved_without_tiling_still_tiles_as_internvl_processor(self, tmp_path):
        """Released ``-hf`` folders may save ``crop_to_patches: false`` (``InternVLProcessor`` turns it on per call):
        the recipe's processor tiles anyway, so measure, encode and the model's training layout agree."""
        recipe = load_recipe(self.recipe)
        cfg = compose_config(self.recipe).model
        recipe.build_model(cfg, "sdpa").save_pretrained(tmp_path / "saved")
        recipe.build_processor(cfg).save_pretrained(tmp_path / "saved")
        saved = tmp_path / "saved" / "preprocessor_config.json"
        saved.write_text(json.dumps({**json.loads(saved.read_text()), "crop_to_patches": False}))
        encoder = recipe.build_encoder(recipe.build_processor({"pretrained": str(tmp_path / "saved")}))
        record = demo_like_records(tmp_path / "records")[0]  # the wide image: 2 x 1 tiles + the thumbnail
        assert encoder.encode(record).media["image_num_patches"].tolist() == [3]
        assert encoder.measure(record).media_tokens == 3 * TILE_TOKENS
