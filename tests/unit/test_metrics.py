import json

import numpy as np
import pytest

from mcit.core import metrics as M


def test_metrics_against_hand_computed_matrix():
    acc = [[90.0, 10.0, 0.0],
           [70.0, 80.0, 5.0],
           [60.0, 50.0, 85.0]]
    counts = [100, 50, 50]
    zs = [8.0, 12.0, 2.0]
    m = M.compute(acc, counts, zs)
    assert m["final_avg_acc"] == pytest.approx((60 * 100 + 50 * 50 + 85 * 50) / 200)  # 63.75
    assert m["final_avg_acc_task_mean"] == pytest.approx((60 + 50 + 85) / 3)
    assert m["avg_incremental_acc"] == pytest.approx((90 + (70 + 80) / 2 + (60 + 50 + 85) / 3) / 3)
    sw = (90 + (70 * 100 + 80 * 50) / 150 + 63.75) / 3
    assert m["avg_incremental_acc_sample_weighted"] == pytest.approx(sw)
    # forgetting: task0 max(90, 70) - 60 = 30; task1 max(80) - 50 = 30
    assert m["forgetting"] == pytest.approx(30.0)
    # bwt: (60 - 90 + 50 - 80) / 2
    assert m["bwt"] == pytest.approx(-30.0)
    # fwd: (acc[0][1] - zs[1] + acc[1][2] - zs[2]) / 2 = (10 - 12 + 5 - 2) / 2
    assert m["fwd"] == pytest.approx(0.5)


def test_forgetting_uses_max_over_earlier_rows_not_diagonal():
    acc = [[50.0, 0.0, 0.0], [80.0, 60.0, 0.0], [40.0, 60.0, 70.0]]
    m = M.compute(acc, [1, 1, 1])
    assert m["forgetting"] == pytest.approx(((80 - 40) + (60 - 60)) / 2)
    assert m["bwt"] == pytest.approx(((40 - 50) + (60 - 60)) / 2)
    assert m["fwd"] is None


def test_single_task_and_non_square_rejected():
    m = M.compute([[77.0]], [3], [10.0])
    assert m["final_avg_acc"] == 77.0 and m["fwd"] is None
    assert (m["forgetting"], m["forgetting_mammoth"], m["bwt"]) == (0.0, 0.0, 0.0)  # numbers, not None
    # two tasks already have a past: task 0 goes 90 -> 70 (forgetting and bwt 20), task 1 was 30 zero-shot, 40
    # before it was learned
    m = M.compute([[90.0, 40.0], [70.0, 80.0]], [1, 1], [10.0, 30.0])
    assert (m["forgetting"], m["forgetting_mammoth"], m["bwt"], m["fwd"]) == (20.0, 20.0, -20.0, 10.0)
    with pytest.raises(ValueError):
        M.compute([[1.0, 2.0]], [1, 1])


def test_heatmap_and_report(tmp_path):
    acc = np.eye(3).tolist()
    M.heatmap(tmp_path / "a.png", ["a", "b", "c"], acc, "t")
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = M.report_markdown("n", "l2p", "tag", ["a", "b", "c"], [1, 1, 1], acc, None, M.compute(acc, [1, 1, 1]))
    assert "| after \\ on | a | b | c |" in md and "final_avg_acc" in md
    json.dumps(M.compute(acc, [1, 1, 1]))


def test_forgetting_maximum_starts_at_the_learned_row_and_stops_before_the_last():
    """Rows are 'after training task t', columns the task evaluated. Task 1 scores 90 before it is learned
    (row 0: the pre-trained model already does it) and improves in the last row (60 -> 70). By the
    definition (Chaudhry et al. 2018), its forgetting is max(acc[1][1]) - acc[2][1] = 60 - 70 = -10, and
    task 0's is max(50, 40) - 30 = 20: mean 5. A maximum from row 0 would count the unlearned 90 (mean 20);
    one over every row including the last gives task 1 max(60, 70) - 70 = 0 (mean 10) -- which is exactly
    mammoth's forgetting, kept as forgetting_mammoth."""
    acc = [[50.0, 90.0, 0.0], [40.0, 60.0, 0.0], [30.0, 70.0, 80.0]]
    m = M.compute(acc, [10, 10, 10])
    assert m["forgetting"] == pytest.approx(5.0)
    assert m["forgetting_mammoth"] == pytest.approx(10.0)


def test_joint_metrics_weight_by_test_counts_and_leave_the_sequence_metrics_undefined():
    m = M.compute_joint([90.0, 50.0], [300, 100])
    assert m["final_avg_acc"] == pytest.approx(80.0) and m["final_avg_acc_task_mean"] == pytest.approx(70.0)
    assert all(m[k] is None for k in ("forgetting", "bwt", "fwd", "avg_incremental_acc"))
    text = M.format_matrix(["a", "b"], [[90.0, 50.0]], rows=["joint"])
    assert text.splitlines()[1].startswith("joint") and "n/a" in M.format_summary(m)


def test_joint_metrics_have_every_key_the_sequence_metrics_have():
    joint, seq = M.compute_joint([90.0, 50.0], [3, 1]), M.compute([[90.0, 10.0], [80.0, 50.0]], [3, 1])
    assert set(joint) == set(seq)  # a table over both kinds of run reads the same keys


def test_text_tables_are_pinned_character_for_character():
    """The console summary, the matrix table and report.md are what users read and scripts grep."""
    m = {"final_avg_acc": 70.0, "final_avg_acc_task_mean": 65.125, "avg_incremental_acc": None, "forgetting": 10.0,
         "bwt": -10.0, "fwd": 1.5}
    assert M.format_summary(m) == ("final_avg_acc=70.00  final_avg_acc_task_mean=65.12  avg_incremental_acc=n/a  "
                                   "forgetting=10.00  bwt=-10.00  fwd=1.50")
    m.update(mft=80.0, mfn=65.125, maa=None)  # MCITlib's columns, on a line of their own
    assert M.format_summary(m).splitlines()[1] == "MCITlib: MFT=80.00  MFN=65.12  MAA=n/a  BWT=-10.00"
    assert M.format_matrix(["colour", "count"], [[99.0, 1.0], [89.0, 75.5]], [90.5, 1.0]) == (
        "after \\ on    colour   count\n"
        "zero-shot      90.50    1.00\n"
        "colour         99.00    1.00\n"
        "count          89.00   75.50")
    assert M.format_matrix(["a", "b"], [[1.0, 2.0]], rows=["joint"]).splitlines()[1] == "joint           1.00    2.00"
    # a task name of 8 characters or more widens every column to its length + 1, so the names stay apart
    assert M.format_matrix(["ocr_vqa_long", "gqa"], [[1.0, 2.0]]).splitlines() == [
        "after \\ on   ocr_vqa_long          gqa", "ocr_vqa_long         1.00         2.00"]
    report = M.report_markdown("run", "lora", "tiny", ["a", "b"], [3, 1], [[90.0, 10.0], [80.0, 50.0]], [85.0, 5.0],
                               {"final_avg_acc": 72.5, "bwt": None}, "0123456789abcdef0123", heatmap_file="h.png")
    assert report == (
        "# run\n\nmethod: `lora` · backbone: `tiny` (sha256 `0123456789abcdef`) · test samples per task: [3, 1]\n\n"
        "## Accuracy matrix (%)\n\n| after \\ on | a | b |\n|---|---|---|\n| zero-shot | 85.00 | 5.00 |\n"
        "| a | 90.00 | 10.00 |\n| b | 80.00 | 50.00 |\n\n![accuracy matrix](h.png)\n\n"
        "## Metrics\n\n| metric | value |\n|---|---|\n| final_avg_acc | 72.50 |\n| bwt (BWT) | n/a |\n")
    bare = M.report_markdown("run", "lora", "tiny", ["a"], [3], [[90.0]], None, {})  # no hash, no zero-shot row
    assert bare.splitlines()[2] == "method: `lora` · backbone: `tiny` · test samples per task: [3]"
    assert "| after \\ on | a |\n|---|---|\n| a | 90.00 |\n\n![accuracy matrix](acc_matrix.png)" in bare


def test_a_non_square_matrix_is_refused_by_name():
    with pytest.raises(ValueError, match="square"):
        M.compute([[1.0, 2.0]], [1, 1])


def test_heatmap_draws_every_cell_on_a_fixed_0_to_100_scale(tmp_path, monkeypatch):
    """The figure itself, caught before it is closed: colours on a fixed 0-100 scale (so two runs' heatmaps
    compare; an auto scale would paint a 50% cell as the best), every cell's number in a colour readable on
    its background, rows "after <task>", columns the evaluated tasks, the title and the colour bar's label;
    the PNG is written."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    path = tmp_path / "m.png"
    M.heatmap(path, ["a", "b", "c"], [[90.0, 10.0, 0.0], [80.0, 59.5, 60.0]], "my run", rows=["one", "two"])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    ax = fig.axes[0]
    assert (ax.images[0].norm.vmin, ax.images[0].norm.vmax) == (0, 100)
    assert ax.images[0].get_array().shape == (2, 3)
    assert [(t.get_text(), t.get_color()) for t in ax.texts] == [
        ("90", "k"), ("10", "w"), ("0", "w"), ("80", "k"), ("60", "w"), ("60", "k")]  # 59.5 is below 60
    assert [lb.get_text() for lb in ax.get_yticklabels()] == ["after one", "after two"]
    assert [lb.get_text() for lb in ax.get_xticklabels()] == ["a", "b", "c"]
    assert ax.get_xlabel() == "evaluated on" and ax.get_title() == "my run"
    assert fig.axes[1].get_ylabel() == "accuracy (%)"  # the colour bar
    close(fig)
    M.heatmap(path, ["a", "b", "c"], [[90.0, 10.0, 0.0], [80.0, 59.5, 60.0]], "mid-sequence")  # 2 of 3 rows so far
    assert [lb.get_text() for lb in figures[-1].axes[0].get_yticklabels()] == ["after a", "after b"]
    close(figures[-1])
