"""Jobs over images: a folder of image files as input, an image column with a prompt template
(the multimodal stage turned on by it)."""

from __future__ import annotations

import pytest

from llmbatch.errors import ConfigError, RowValidationError
from llmbatch.io.readers import infer_format, read_rows
from llmbatch.jobs.prompts import job_preprocess
from llmbatch.jobs.spec import load_job
from llmbatch.sample_images import write_image_folder, write_image_parquet


def test_a_folder_of_images_is_read_as_one_row_per_file(tmp_path):
    folder = tmp_path / "imgs"
    paths = write_image_folder(folder, 5, seed=1, corrupt=1)
    (folder / "notes.txt").write_text("not an image")
    (folder / "sub").mkdir()
    write_image_folder(folder / "sub", 2, seed=2)
    assert infer_format(str(folder)) == "images"
    rows = [r for batch in read_rows(str(folder)) for r in batch]
    assert [r["name"] for r in rows] == sorted(p.name for p in paths) + ["sub/img_00000.png", "sub/img_00001.png"]
    assert all(r["path"].startswith(str(folder.resolve())) and r["__llmbatch_read_error"] == "" for r in rows)


def test_sample_images_are_seeded_and_some_are_corrupt(tmp_path):
    from llmbatch.sample_images import sample_images

    a, b = sample_images(12, seed=4, corrupt=3), sample_images(12, seed=4, corrupt=3)
    assert [x["image"] for x in a] == [x["image"] for x in b]
    assert sum(x["corrupt"] for x in a) == 3
    table = write_image_parquet(tmp_path / "i.parquet", 4, seed=4)
    assert table.exists()


def test_an_image_column_puts_the_image_before_the_prompt_and_enables_the_stage(tmp_path):
    data = write_image_parquet(tmp_path / "images.parquet", 3, seed=0)
    spec = load_job(data={"input": {"path": str(data)}, "model": {"source": "smollm2-135m-instruct"},
                          "prompt": {"user": "Describe this image ({id}).", "image_column": "image"},
                          "output": {"path": str(tmp_path / "out.parquet")}})
    assert spec.processor_config().prepare_multimodal_stage.enabled
    row = {"id": 7, "image": b"\x89PNG..."}
    out = job_preprocess(spec)(row)
    assert out["messages"] == [{"role": "user", "content": [{"type": "image", "image": b"\x89PNG..."},
                                                            {"type": "text", "text": "Describe this image (7)."}]}]
    with pytest.raises(RowValidationError, match="column 'image' \\(the image\\) is empty"):
        job_preprocess(spec)({"id": 1, "image": None})
    with pytest.raises(ConfigError, match="image_column needs a prompt.user"):
        load_job(data={"input": {"path": str(data)}, "model": {"source": "smollm2-135m-instruct"},
                       "prompt": {"prompt_column": "id", "image_column": "image"},
                       "output": {"path": str(tmp_path / "out.parquet")}})
