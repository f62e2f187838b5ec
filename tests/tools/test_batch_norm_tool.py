"""tools/batch_norm.py's table, from rows made here (the measurement itself is a tool's
run, minutes long, not a test)."""

from tools import batch_norm


def test_the_table_says_what_each_row_is():
    rows = [("BatchNormalization", 1, 100, "(direct)", 61.0, 0.0),
            ("BatchNormalization", 20, 5, "update", 52.0, 1.5),
            ("BatchNormalization", 20, 5, "mini_batch", 90.25, 2.0),
            ("GroupNormalization", 20, 5, "update", 91.5, None)]
    text = batch_norm.table(rows, "python -m tools.batch_norm", 300)
    lines = text.splitlines()
    assert "`python -m tools.batch_norm`" in lines[0] and "300 updates of 100" in lines[0]
    body = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert body[0].startswith("| BatchNormalization | 1 x 100 | the direct batch | 300 |")
    assert "| 300 | 52.00% | 1.5 |" in body[1] and "default" in body[1]
    assert "| 6,000 | 90.25% | 2 |" in body[2] and "Keras's own" in body[2]
    assert body[3].endswith("| - | 91.50% | - |")
