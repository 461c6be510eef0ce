"""The InternVL encoder and artifacts (the kit's ``EncoderSuite``: measure == encode, assistant-only labels, errors
naming the record, the encoding equal to transformers' ``InternVLProcessor``'s (ids and stacked tiles), save/load
round trip, a reproducible tokenizer asset), plus the tile layout, the per-image tile and token counts that processor
computes from the image sizes alone, and a pretrained folder saved without tiling."""

from __future__ import annotations

import json

import torch
from transformers import InternVLProcessor

import mvp_engine.engine.testing as kit
from mvp_engine.engine.testkit.suites import EncoderSuite
from mvp_engine.kit.mllm.data import load_image
from recipes.internvl.model import tiny_config

TILE_TOKENS = 16  # (56 / 7)^2 patches, pixel shuffle 0.5


class TestEncoder(EncoderSuite):
    recipe = "internvl"
    encoder_only_fields = ("image_num_patches",)  # tiles per image: the processor counts them, but returns none

    @classmethod
    def hf_processor(cls, encoder):
        """``InternVLProcessor`` with the model config's ``image_seq_length`` context tokens per tile."""
        config = tiny_config(kit.compose_config(cls.recipe).model, encoder.tokenizer)
        return kit.transformers_processor(InternVLProcessor, encoder, image_seq_length=config.image_seq_length)

    def test_every_image_is_its_tiles_context_tokens_between_img_and_end_img(self, encoder, tmp_path):
        """The fixture's wide (90x60) and tall (50x120) images tile 2x1 and 1x2 (+ a thumbnail), the square and
        the small one are one tile; the tiles are stacked in image order and ``image_num_patches`` counts them."""
        tiles = {"img0": [3], "txt0": [], "multi": [1, 3, 1], "txt1": [], "img1": [1]}
        for record in kit.demo_like_records(tmp_path):
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

    def test_tiles_and_tokens_per_image_are_the_processors_count_from_the_sizes(self, encoder, tmp_path):
        """``image_num_patches`` (which ``InternVLProcessor`` does not return) and ``measure``'s token counts equal
        the processor's own from the image sizes (``_get_num_multimodal_tokens``: 2 + tiles x 16 per image)."""
        processor = self.hf_processor(encoder)
        for record in kit.demo_like_records(tmp_path):
            if not record.image_paths:
                continue
            sizes = [(image.height, image.width) for image in map(load_image, record.image_paths)]
            counted = processor._get_num_multimodal_tokens(image_sizes=sizes)
            assert counted["num_image_patches"] == encoder.encode(record).media["image_num_patches"].tolist()
            assert sum(counted["num_image_tokens"]) == encoder.measure(record).media_tokens + 2 * len(sizes)

    def test_a_pretrained_folder_saved_without_tiling_still_tiles_as_internvl_processor(self, tmp_path):
        """Released ``-hf`` folders may save ``crop_to_patches: false`` (``InternVLProcessor`` turns it on per call):
        the recipe's processor tiles anyway, so measure, encode and the model's training layout agree."""
        recipe = kit.load_recipe(self.recipe)
        cfg = kit.compose_config(self.recipe).model
        recipe.build_model(cfg, "sdpa").save_pretrained(tmp_path / "saved")
        recipe.build_processor(cfg).save_pretrained(tmp_path / "saved")
        saved = tmp_path / "saved" / "preprocessor_config.json"
        saved.write_text(json.dumps({**json.loads(saved.read_text()), "crop_to_patches": False}))
        encoder = recipe.build_encoder(recipe.build_processor({"pretrained": str(tmp_path / "saved")}))
        record = kit.demo_like_records(tmp_path / "records")[0]  # the wide image: 2 x 1 tiles + the thumbnail
        assert encoder.encode(record).media["image_num_patches"].tolist() == [3]
        assert encoder.measure(record).media_tokens == 3 * TILE_TOKENS
