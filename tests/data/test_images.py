"""Rows with images (megarl/data/images.py) and the procedural visual task (visual_task.py): images
decode when the dataset loads, and a row whose image is missing, corrupt, the wrong size, or shown
to a model without a vision tower is refused naming the row and the image, or dropped and counted
(data.bad_images=filter)."""

from __future__ import annotations

import numpy as np
import pytest

from megarl.data.dataset import DatasetError, RLDataset
from megarl.data.images import ImageLimits, check_images, decode_image
from megarl.data.tasks import write_task
from megarl.data.visual_task import COLOURS, SIDE, make_shapes_rows
from megarl.models.tiny import build_tokenizer

QWEN_VL = ImageLimits(min_side=28, max_pixels=1024 * 1024)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _load(rows, tokenizer, **kw):
    return RLDataset(rows, tokenizer, max_prompt_length=32, source="shapes.parquet", **kw)


def test_shapes_rows_survive_parquet_and_show_their_answer(tmp_path, tokenizer):
    path = write_task("shapes", 32, seed=3, path=tmp_path / "shapes.parquet")
    data = RLDataset.from_file(path, tokenizer, max_prompt_length=32, images=QWEN_VL)
    assert len(data) == 32 and data.num_bad_images == 0
    answers = set()
    for row in data.rows:
        [image] = check_images(row, "row", QWEN_VL)
        pixels = np.asarray(image)
        answer = row["reward_model"]["ground_truth"]
        answers.add(answer)
        assert pixels.shape == (SIDE, SIDE, 3)
        # the square is the answer's colour, and no other colour of the palette is drawn
        drawn = {c for c, rgb in COLOURS.items() if (pixels == rgb).all(-1).sum() >= 14 * 14}
        assert drawn == {answer}
    assert answers == set(COLOURS)  # every colour occurs: the task is not one letter
    assert make_shapes_rows(4, seed=1) == make_shapes_rows(4, seed=1)


def _bad(rows, index, **change):
    rows = [dict(r) for r in rows]
    rows[index] = {**rows[index], **change}
    return rows


@pytest.mark.parametrize(
    "change, message",
    [
        ({"images": [{"bytes": b"\x89PNG\r\n\x1a\n truncated", "path": None}]}, "images[0]: the image does not decode"),
        (
            {"images": [{"bytes": None, "path": "/nonexistent/a.png"}]},
            "images[0]: image file /nonexistent/a.png does not exist",
        ),
        ({"images": []}, None),  # no image: fine for the dataset (the marker count is checked below)
        ({"images": [{"bytes": None, "path": None}]}, "images[0]: an image dict needs 'bytes' or 'path'"),
        ({"images": [np.zeros((20, 20, 3), np.uint8)]}, "images[0] is 20 x 20; the model takes sides >= 28"),
        ({"images": [np.zeros((56, 56), np.uint8)]}, "an image array must be uint8 [H, W, 3]"),
        ({"images": [make_shapes_rows(1)[0]["images"][0]] * 2}, "1 <image> marker(s) but the row has 2 image(s)"),
    ],
)
def test_a_bad_image_is_refused_by_row_or_dropped_and_counted(tokenizer, change, message):
    rows = _bad(make_shapes_rows(6, seed=0), 3, **change)
    if message is None:
        assert len(_load(rows, tokenizer, images=QWEN_VL)) == 6
        return
    with pytest.raises(DatasetError) as info:
        _load(rows, tokenizer, images=QWEN_VL)
    assert str(info.value).startswith("shapes.parquet row 3: ") and message in str(info.value), str(info.value)
    kept = _load(rows, tokenizer, images=QWEN_VL, bad_images="filter")
    assert len(kept) == 5 and kept.num_bad_images == 1
    assert [r["extra_info"]["index"] for r in kept.rows] == [0, 1, 2, 4, 5]


def test_a_model_without_a_vision_tower_refuses_rows_with_images(tokenizer):
    with pytest.raises(DatasetError, match="row 0: the row has images, but the model takes no images"):
        _load(make_shapes_rows(2), tokenizer)  # images=None: a text model


def test_image_forms_decode_alike(tmp_path):
    from PIL import Image

    stored = make_shapes_rows(1, seed=2)[0]["images"][0]
    want = np.asarray(decode_image(stored, "x"))
    (tmp_path / "a.png").write_bytes(stored["bytes"])
    forms = [stored["bytes"], {"bytes": None, "path": str(tmp_path / "a.png")}, str(tmp_path / "a.png"), want]
    forms.append(Image.fromarray(want).convert("RGBA"))  # converted to RGB
    for form in forms:
        assert np.array_equal(np.asarray(decode_image(form, "x")), want)


def test_shapes_reward_reads_the_first_letter():
    from megarl.reward.rule import shapes_score

    assert shapes_score(" r", "r", {}) == 1.0 and shapes_score("rg", "r", {}) == 1.0
    assert shapes_score("g", "r", {}) == 0.0 and shapes_score("", "r", {}) == 0.0


def test_a_vision_model_s_prompt_holds_one_pad_per_image_and_batches_carry_the_images():
    from megarl.data.dataset import PromptBatches
    from megarl.models.tiny_vlm import TOKEN_IDS, build_tokenizer

    tok = build_tokenizer()
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    data = _load(make_shapes_rows(8, seed=1), tok, images=ImageLimits(min_side=28, placeholder=placeholder))
    ids = data.rows[0]["raw_prompt_ids"]
    start, pad, end = TOKEN_IDS["vision_start_token_id"], TOKEN_IDS["image_token_id"], TOKEN_IDS["vision_end_token_id"]
    assert ids.count(pad) == 1 and ids[ids.index(pad) - 1 : ids.index(pad) + 2] == [start, pad, end]
    assert (
        tok.decode(ids, skip_special_tokens=False).replace(placeholder, "<image>")
        == "<|user|><image>colour?<|assistant|>"
    )
    batch = PromptBatches(data, 4, shuffle=False).batch_at(0)
    assert [len(x) for x in batch["images"]] == [1] * 4
    assert np.asarray(batch["images"][0][0]).shape == (SIDE, SIDE, 3)
    # without a placeholder (a text model's tokenizer) the marker stays text and no pad appears
    text_rows = [{**r, "images": None} for r in make_shapes_rows(2, seed=1)]
    plain = _load(text_rows, tok)
    assert pad not in plain.rows[0]["raw_prompt_ids"] and "images" not in plain.rows[0]
    assert "images" not in PromptBatches(plain, 2, shuffle=False).batch_at(0)
