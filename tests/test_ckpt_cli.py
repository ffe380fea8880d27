"""`trainguard ckpt ls | verify | inspect | recover` on checkpoints saved by 2 real gloo ranks
(data parallel: the ranks are replicas; tensor parallel: each rank alone)."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
from shard_group import REPO, run_group

from trainguard.launch.cli import main

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt_cli")
    run_group("ckpt_cli", 2, out)
    return out


@pytest.fixture
def dp(saved, tmp_path):
    return shutil.copytree(saved / "dp" / "sliced", tmp_path / "dp")


def ckpt(capsys, *args):
    code = main(["ckpt", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_lists_checkpoints_oldest_first(saved, capsys, tmp_path):
    shutil.copytree(saved / "dp" / "sliced", tmp_path / "a")
    shutil.copytree(saved / "tp" / "full", tmp_path / "b")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "manifest.json").write_text("{")
    code, out, _ = ckpt(capsys, "ls", tmp_path)
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:5] == ["step", "name", "epoch", "world", "kind"]
    assert "INCOMPLETE" in lines[1] and lines[1].split()[1] == "half"
    assert lines[2].split()[:6] == ["2", "a", "1", "2", "sliced", "2"] and "complete" in lines[2]
    assert lines[3].split()[:6] == ["2", "b", "1", "2", "integrated", "1"]
    code, _, err = ckpt(capsys, "ls", tmp_path / "nope")
    assert code == 2 and "nope: is not a directory" in err


def test_inspect_shows_layout_and_group_info(saved, capsys):
    code, out, _ = ckpt(capsys, "inspect", saved / "tp" / "sliced")
    assert code == 0 and "kind sliced" in out and "[[0], [1]]" in out
    assert "model/0.weight: F32 [32, 16] S(0): [0:16, 0:16] on [0]; [16:32, 0:16] on [1]" in out
    assert "model/2.bias: F32 [10] R: [0:10] on [0, 1]" in out
    code, out, _ = ckpt(capsys, "inspect", "--json", saved / "dp" / "sliced" / "rank_1.safetensors")
    assert code == 0 and json.loads(out)["layout"]["group_info"] == [[0, 1], [0, 1]]


def test_verify_then_recover_a_deleted_rank(dp, capsys):
    code, out, _ = ckpt(capsys, "verify", dp)
    assert code == 0 and "OK, 2 file(s)" in out
    original = (dp / "rank_0.safetensors").read_bytes()
    (dp / "rank_0.safetensors").unlink()
    (dp / "rank_0.group_info.json").unlink()
    code, out, err = ckpt(capsys, "verify", dp)
    assert code == 2 and "CORRUPT  rank_0.safetensors: is missing" in out
    assert f"still loads; rebuild them with: trainguard ckpt recover {dp} --rank 0" in err
    code, out, _ = ckpt(capsys, "recover", dp, "--rank", 0)
    assert code == 0 and "rebuilt from rank(s) [1]; its sha256 matches the manifest" in out
    manifest = json.loads((dp / "manifest.json").read_text())
    rebuilt = (dp / "rank_0.safetensors").read_bytes()
    assert rebuilt == original
    assert hashlib.sha256(rebuilt).hexdigest() == manifest["files"]["rank_0.safetensors"]["sha256"]
    assert json.loads((dp / "rank_0.group_info.json").read_text())["group_info"] == [0, 1]
    assert ckpt(capsys, "verify", dp)[0] == 0
    code, out, _ = ckpt(capsys, "recover", dp, "--rank", 0)
    assert code == 0 and "intact, nothing to do" in out


def test_unrecoverable_damage_exits_2_with_advice(saved, tmp_path, capsys):
    tp = shutil.copytree(saved / "tp" / "sliced", tmp_path / "tp")
    (tp / "rank_1.safetensors").write_bytes((tp / "rank_1.safetensors").read_bytes()[:100])
    code, out, err = ckpt(capsys, "verify", tp)
    assert code == 2 and "CORRUPT  rank_1.safetensors: is 100 bytes" in out
    assert "no intact copy is left of model/0.bias [16:32]" in err and "fall back to an earlier checkpoint" in err
    code, _, err = ckpt(capsys, "recover", tp, "--rank", 1)
    assert code == 2 and f"{tp / 'rank_1.safetensors'}: rank 1 alone holds tensor" in err
    code, _, err = ckpt(capsys, "recover", tp, "--rank", 5)
    assert code == 2 and "there is no rank 5" in err
    code, _, err = ckpt(capsys, "recover", saved / "tp" / "full", "--rank", 0)
    assert code == 2 and "integrated checkpoint" in err


def test_the_installed_command_exits_2_naming_the_file(dp):
    (dp / "manifest.json").unlink()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "trainguard", "ckpt", "verify", str(dp)], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("trainguard ckpt: ") and f"{dp / 'manifest.json'}: is missing" in proc.stderr
