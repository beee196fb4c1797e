"""GGUFHeader (models/loader/gguf_header.py) reads what gguf.GGUFReader reads of a file's header: every
field's contents and the tensor directory, and read_config built on it equals the config load_gguf builds;
GGUFTensors gives each tensor's data as GGUFReader does (the loader reads the weights from it)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from specserve.models.loader import demo_model_path, load_checkpoint, read_config
from specserve.models.loader.gguf_header import GGUFHeader, GGUFTensors


def _write(path: Path) -> Path:
    """A file with a field of every value type and arrays of scalars and strings, over three tensors."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 2**60)
    w.add_int64("t.i64", -(2**60))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo {{ template }}")
    w.add_array("t.ints", [3, 1, 4, 1, 5])
    w.add_array("t.floats", [0.5, -2.25])
    w.add_token_list([f"tok{i}" for i in range(300)] + ["", "ü"])
    w.add_token_merges(["a b", "ab c"] * 50)
    w.add_tensor("token_embd.weight", np.arange(32 * 8, dtype=np.float32).reshape(32, 8))
    w.add_tensor("blk.0.attn_q.weight", np.ones((8, 8), dtype=np.float16))
    w.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_fields_and_tensors_are_gguf_readers(tmp_path: Path) -> None:
    path = _write(tmp_path / "fields.gguf")
    reader, header = gguf.GGUFReader(path), GGUFHeader(path)
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert len(keys) > 15
    for key in keys:
        ours = header.get_field(key)
        assert ours is not None, key
        assert ours.contents() == reader.fields[key].contents(), key
    assert header.get_field("no.such.key") is None
    assert [(t.name, t.shape, t.tensor_type) for t in header.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type)) for t in reader.tensors
    ]


def test_read_config_equals_the_loaders(tmp_path: Path) -> None:
    from test_loader import tiny_model, write_gguf

    path = write_gguf(tiny_model("llama_untied"), "llama", tmp_path / "tiny.gguf")
    assert read_config(path) == load_checkpoint(path).config


@pytest.mark.parametrize("content", [b"", b"GGML" + bytes(40), b"GGUF" + bytes(3)])
def test_not_a_gguf_header_is_a_clear_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="bad.gguf"):
        GGUFHeader(path)


def _same_tensors(path: Path) -> int:
    reader, ours = gguf.GGUFReader(path), GGUFTensors(GGUFHeader(path))
    assert len(ours.tensors) == len(reader.tensors)
    for a, b in zip(ours.tensors, reader.tensors):
        assert (a.name, a.shape, a.tensor_type) == (b.name, tuple(int(d) for d in b.shape), b.tensor_type)
        assert (a.data_offset, a.n_bytes) == (int(b.data_offset), int(b.n_bytes)), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name
        assert not a.data.flags.writeable  # a view of the file, as the reader's
    return len(ours.tensors)


def test_tensors_are_gguf_readers(tmp_path: Path) -> None:
    assert _same_tensors(_write(tmp_path / "fields.gguf")) == 3


def test_the_demo_ggufs_quantized_tensors_are_gguf_readers() -> None:
    """Q4_1 and Q8_0 blocks as [rows, bytes a row], float32 norms typed, offsets past the aligned header."""
    assert _same_tensors(demo_model_path()) > 200


def test_a_truncated_file_names_its_tensor(tmp_path: Path) -> None:
    path = _write(tmp_path / "cut.gguf")
    path.write_bytes(path.read_bytes()[:-16])
    with pytest.raises(ValueError, match="output_norm.weight runs past the end"):
        GGUFTensors(GGUFHeader(path))
