"""`ttftc cache list|clear DIR`: the disk tier's blocks as its operator sees them, and bad input."""

import json

import torch

from tests.bench.helpers import error_lines, run_cli
from ttftc.runtime.kv_disk import KVDiskTier, child_address, root_address


def _tier_with_blocks(path, count: int) -> int:
    tier = KVDiskTier(path, 1 << 20, model_key="m", dtype=torch.float32, block_shape=(1, 2, 1, 4, 8))
    for i in range(count):
        tier.store(child_address(root_address("m", "default"), (i, i, i, i)), torch.full((1, 2, 1, 4, 8), float(i)))
    return tier.stats().bytes


def test_list_counts_blocks_and_clear_deletes_only_them(tmp_path, capsys):
    nbytes = _tier_with_blocks(tmp_path, 3)
    (tmp_path / "README").write_text("not a block")
    status, out, _ = run_cli(["cache", "list", str(tmp_path), "--json"], capsys)
    assert status == 0 and json.loads(out) == {"directory": str(tmp_path), "blocks": 3, "bytes": nbytes}
    status, out, _ = run_cli(["cache", "clear", str(tmp_path)], capsys)
    assert status == 0 and out.strip() == f"removed 3 KV blocks from {tmp_path}"
    assert [p.name for p in tmp_path.iterdir()] == ["README"]
    status, out, _ = run_cli(["cache", "list", str(tmp_path)], capsys)
    assert status == 0 and out.strip() == f"{tmp_path}: 0 KV blocks, 0.0 MiB"


def test_a_missing_directory_or_action_is_a_usage_error(tmp_path, capsys):
    status, _, err = run_cli(["cache", "list", str(tmp_path / "nope")], capsys)
    assert status == 2 and "is not a directory; give the directory that `ttftc serve --kv-disk` was given" in err
    status, _, err = run_cli(["cache", "drop", str(tmp_path)], capsys)
    assert status == 2 and "invalid choice: 'drop'" in error_lines(err)[-1]
