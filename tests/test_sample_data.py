from llmbatch.sample_data import COLUMNS, customers, write_customers_csv


def test_seeded_and_shaped(tmp_path):
    a = list(customers(300, seed=4))
    b = list(customers(300, seed=4))
    assert a == b and list(customers(300, seed=5)) != a
    assert list(a[0]) == COLUMNS
    assert [r["Index"] for r in a] == list(range(1, 301))
    assert all(len(r["Customer Id"]) == 15 and "@" in r["Email"] and r["Website"].startswith("http") for r in a)


def test_companies_repeat_like_real_data():
    rows = list(customers(2000, seed=1))
    counts = {}
    for r in rows:
        counts[r["Company"]] = counts.get(r["Company"], 0) + 1
    top = max(counts.values())
    assert 1 < len(counts) < 2000 and top >= 20  # a few big customers, a long tail
    assert sum(1 for c in counts.values() if c == 1) > 10


def test_streams_any_number_of_rows_to_disk(tmp_path):
    path = write_customers_csv(tmp_path / "c.csv", 10_001, seed=2)
    lines = path.read_text().splitlines()
    assert lines[0] == ",".join(COLUMNS) and len(lines) == 10_002
