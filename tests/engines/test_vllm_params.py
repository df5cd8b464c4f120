"""A row's sampling params: built once per distinct setting, checked every time, never shared."""

from __future__ import annotations

import numpy as np
import pytest

from llmbatch.engines.vllm_params import sampling_params
from llmbatch.errors import RowValidationError
from llmbatch.rows import int_list


def test_equal_settings_give_equal_params_that_are_not_the_same_object():
    a, ca = sampling_params({"temperature": 0, "max_tokens": 4}, 512, True)
    b, cb = sampling_params({"max_tokens": 4, "temperature": 0}, 512, True)
    assert a is not b and ca == cb == {"temperature": 0, "max_tokens": 4}
    assert (b.max_tokens, b.temperature, b.detokenize) == (4, 0, False)
    b.max_tokens = 99  # the engine stage changes a request's own params (OpenAI's max_tokens auto)
    assert sampling_params({"temperature": 0, "max_tokens": 4}, 512, True)[0].max_tokens == 4


def test_the_context_limit_and_unknown_names_are_checked_for_every_row():
    assert sampling_params({"max_tokens": 600}, 1024)[0].max_tokens == 600
    with pytest.raises(RowValidationError, match="max_model_len is 512"):
        sampling_params({"max_tokens": 600}, 512)
    for _ in range(2):
        with pytest.raises(RowValidationError, match="unknown sampling param 'temprature'"):
            sampling_params({"temprature": 0})


def test_token_ids_become_python_ints_from_lists_and_arrays():
    assert int_list(np.array([3, 4], dtype=np.int64)) == [3, 4]
    assert all(type(t) is int for t in int_list(np.array([3, 4], dtype=np.int32)))
    assert int_list([np.int64(5), 6]) == [5, 6] and all(type(t) is int for t in int_list([np.int64(5), 6]))
