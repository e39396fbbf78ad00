"""The train stage's small helpers: the data seed and the rank-0 log."""

import json

from mcit.engine import JsonlLogger, data_seed


def test_data_seeds_differ_for_every_task_epoch_and_rank_and_fit_32_bits():
    """Every (seed, task, epoch, rank) of a long run gets its own shuffle seed (a repeated seed repeats an
    epoch's order, or gives two ranks the same one), and each fits a signed 32-bit seed (numpy's limit is
    2**32, a DataLoader worker's base seed is added to it)."""
    grid = [(s, t, e, r) for s in range(3) for t in range(12) for e in range(60) for r in range(8)]
    seeds = [data_seed(*g) for g in grid]
    assert len(set(seeds)) == len(grid)
    assert all(0 <= x < 2 ** 31 for x in seeds)
    assert all(data_seed(i * 2_654_435_761, 5, 7, 3) < 2 ** 31 for i in range(64))  # large config seeds fold in


def test_log_creates_its_folder_and_appends_across_restarts(tmp_path):
    """A resumed run opens the same log again: the folder exists then, and the old lines stay."""
    path = tmp_path / "run" / "logs" / "train.jsonl"
    JsonlLogger(path).log({"task": 0, "loss": 1.5}, step=1)
    again = JsonlLogger(path)
    again.log({"task": 0, "loss": 1.25}, step=2)
    assert [json.loads(line)["loss"] for line in path.read_text().splitlines()] == [1.5, 1.25]
    assert again.tb is None and not (tmp_path / "runs").exists()  # no TensorBoard writer without tb_dir
