"""What scripts/gpu_check.sh runs, dry-run on the CPU: the per-rank replay of a plan's
compute against the simulator (bench/rank_replay.py), and the script itself parses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # as bench/ scripts import their `_common`
import rank_replay  # bench/rank_replay.py, once its folder is on the path

ROOT = Path(__file__).resolve().parents[1]


def test_rank_replay_dry_run(tmp_path):
    out = tmp_path / "replay"
    args = ["--device", "cpu", "--cluster", "cpu", "--nodes", "2", "--gpus-per-node", "2", "--model", "tiny",
            "--tokens-per-gpu", "256", "--repeats", "1", "--out", str(out)]
    assert rank_replay.main(args) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["num_gpus"] == 4 and len(result["ranks"]) == 4 and result["rings"] >= 1
    for row in result["ranks"]:
        assert row["attention_fwd_ms"] > 0 and row["attention_bwd_ms"] > 0 and row["linear_fwd_bwd_ms"] > 0
        assert row["sim_attention_fwd_ms"] > 0 and row["sim_linear_fwd_ms"] > 0
    assert "measured / simulated" in out.with_suffix(".md").read_text()


def test_gpu_scripts_parse():
    for script in ("gpu_check.sh", "gpu_train_check.sh"):
        assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], check=False).returncode == 0
