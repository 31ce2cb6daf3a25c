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
