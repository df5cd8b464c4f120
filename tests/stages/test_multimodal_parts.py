"""Content parts: every accepted form becomes a decoded image part, unknown types and keys are
errors that name them, and the row's media digest tells different images apart."""

from __future__ import annotations

import base64
import io

import pytest

from llmbatch.errors import RowValidationError
from llmbatch.io.media import MediaPolicy
from llmbatch.stages.multimodal import prepare_messages


def png(color: str) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 6), color).save(buf, format="PNG")
    return buf.getvalue()


def user(*parts):
    return [{"role": "user", "content": list(parts)}]


def test_ray_and_openai_forms_become_decoded_image_parts_in_order():
    data = png("red")
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    messages = [{"role": "system", "content": "Be brief."}] + user(
        {"type": "image", "image": data}, {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": url}}, {"type": "input_image", "image_url": url})
    out, digest = prepare_messages(messages, MediaPolicy())
    assert out[0] == {"role": "system", "content": "Be brief."}
    kinds = [p["type"] for p in out[1]["content"]]
    assert kinds == ["image_pil", "text", "image_pil", "image_pil"]
    assert out[1]["content"][0]["image_pil"].size == (8, 6)
    assert digest is not None and messages[1]["content"][0]["image"] == data  # the input is not changed


def test_same_text_different_images_have_different_digests():
    text = {"type": "text", "text": "What is this?"}
    _, red = prepare_messages(user({"type": "image", "image": png("red")}, text), MediaPolicy())
    _, red2 = prepare_messages(user({"type": "image", "image": png("red")}, text), MediaPolicy())
    _, blue = prepare_messages(user({"type": "image", "image": png("blue")}, text), MediaPolicy())
    _, none = prepare_messages(user(text), MediaPolicy())
    assert red == red2 and red != blue and none is None
    _, a = prepare_messages(user({"type": "image", "image": png("red"), "uuid": "a"}), MediaPolicy())
    _, b = prepare_messages(user({"type": "image", "image": png("red"), "uuid": "b"}), MediaPolicy())
    assert a != b  # a user's uuid names the item


@pytest.mark.parametrize("part,match", [
    ({"type": "picture", "image": b"x"}, r"unknown content part type 'picture' \(it has a 'image' key"),
    ({"type": "image", "images": [b"x"]}, r"content\[0\] \(type 'image'\) has unknown key 'images'"),
    ({"type": "image_url", "url": "http://x"}, r"unknown key 'url'; a 'image_url' part takes 'image_url'"),
    ({"type": "image"}, r"has no 'image'"),
    ({"type": "image", "image": b"garbage"}, r"messages\[0\].content\[0\]: the image is not a decodable image"),
])
def test_bad_parts_are_errors_that_name_them(part, match):
    with pytest.raises(RowValidationError, match=match):
        prepare_messages(user(part), MediaPolicy())


def test_bad_messages_are_errors_that_name_them():
    with pytest.raises(RowValidationError, match=r"messages\[0\] has unknown key 'images'"):
        prepare_messages([{"role": "user", "content": "hi", "images": [b"x"]}], MediaPolicy())
    with pytest.raises(RowValidationError, match="role 'robot'"):
        prepare_messages([{"role": "robot", "content": "hi"}], MediaPolicy())


def test_media_in_messages_without_the_multimodal_stage_says_how_to_enable_it():
    from llmbatch.stages.chat_template import ChatTemplateStage

    stage = ChatTemplateStage("unused")
    stage.tokenizer = object()  # never reached
    with pytest.raises(RowValidationError, match="prepare_multimodal_stage"):
        stage.process_row({"messages": user({"type": "image", "image": b"x"}, {"type": "text", "text": "hi"})})


def test_apply_sys_msg_formatting_keeps_system_prompts_as_plain_text():
    from llmbatch.engines.vllm_chat import _text_of

    assert _text_of([{"type": "text", "text": "Be"}, "brief."]) == "Be\nbrief."
    assert _text_of("Be brief.") == "Be brief."
    with pytest.raises(RowValidationError, match="only text when apply_sys_msg_formatting"):
        _text_of([{"type": "image_pil", "image_pil": None}])


def test_other_openai_parts_pass_to_vllms_parser_as_they_are():
    parts = [{"type": "refusal", "refusal": "no"}, {"type": "output_text", "text": "ok"},
             {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}]
    out, digest = prepare_messages([{"role": "assistant", "content": parts}], MediaPolicy())
    assert out[0]["content"] == parts and digest is not None  # the video is media: the row has a digest
    with pytest.raises(RowValidationError, match="not in allowed_media_domains"):
        prepare_messages([{"role": "user", "content": parts[2:]}], MediaPolicy(allowed_media_domains=["a.org"]))
