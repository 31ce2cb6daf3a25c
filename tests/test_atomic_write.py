"""A file written whole or not at all: what a reader, or a run restarted after a crash, sees."""
import pytest

from pretrain.atomic_write import write_atomic


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "_info.json"
    write_atomic(path, '{"name": "old"}')

    def half_then_full_disk(tmp):
        tmp.write_text('{"name": "ne')
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, half_then_full_disk)
    assert path.read_text() == '{"name": "old"}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_info.json"]

    write_atomic(path, b'{"name": "new"}')  # bytes, text and writer functions alike
    assert path.read_text() == '{"name": "new"}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_info.json"]


def test_a_safetensors_file_gets_the_mode_of_any_other_file_written_here(tmp_path):
    """safetensors' save_file makes its file private (0600): exported models and the MLflow
    copies of them could not be read by anyone else on a shared cluster file system."""
    import os
    import stat

    import torch
    from safetensors.torch import save_file

    before = os.umask(0o022)  # the usual one: files readable by all, writable by the owner
    try:
        plain = write_atomic(tmp_path / "best.json", "{}")
        weights = write_atomic(tmp_path / "best.safetensors",
                               lambda tmp: save_file({"w": torch.zeros(2)}, str(tmp)))
    finally:
        os.umask(before)
    assert stat.S_IMODE(os.stat(plain).st_mode) == 0o644
    assert stat.S_IMODE(os.stat(weights).st_mode) == 0o644
