"""``llmbatch verify``'s report: what it says when it checked rows, and when it could check none."""

from __future__ import annotations

import math

from llmbatch.jobs.verify import VerifyReport


def test_a_sample_of_random_answers_only_is_no_agreement_and_says_what_verify_needs():
    """Every sampled row sampled at temperature 1 (the default): nothing was compared, and the
    report said "agreement 100.0% (0 of 0 rows)"."""
    none = VerifyReport(checked=0, agreed=0, skipped_random=3)
    assert math.isnan(none.agreement) and not none.agreement >= 0.99
    assert none.agreement_text().startswith("none checked: every sampled row's answer is random by design")
    assert "temperature 0" in none.summary() and "100" not in none.summary()
    some = VerifyReport(checked=4, agreed=3, skipped_random=1)
    assert some.agreement == 0.75 and some.agreement_text() == "75.0% (3 of 4 rows)"
    assert some.summary() == "agreement 75.0% (3 of 4 rows); 1 rows with random answers skipped"
