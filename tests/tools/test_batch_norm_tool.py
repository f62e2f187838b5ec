"""tools/batch_norm.py's table, from rows made here (the measurement itself is a tool's
run, minutes long, not a test)."""

from tools import batch_norm


def test_the_table_says_what_each_row_is():
    rows = [("BatchNormalization", 1, 100, "(direct)", 59.2, 0.0),
            ("BatchNormalization", 20, 5, "update", 50.3, 1.0),
            ("BatchNormalization", 20, 5, "mini_batch", 96.5, 1.4),
            ("GroupNormalization", 20, 5, "update", 96.6, None)]
    text = batch_norm.table(rows, "python -m tools.batch_norm", 300)
    lines = text.splitlines()
    assert "`python -m tools.batch_norm`" in lines[0] and "300 updates of 100" in lines[0]
    body = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert body[0].startswith("| BatchNormalization | 1 x 100 | the direct batch | 300 |")
    assert "| 300 | 50.30% | 1 |" in body[1] and "default" in body[1]
    assert "| 6,000 | 96.50% | 1.4 |" in body[2] and "Keras's own" in body[2]
    assert body[3].endswith("| - | 96.60% | - |")
