"""Calibration data (calibration/data.py): each source format, batching, and each rejection's message."""

from __future__ import annotations

import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from calibration.data import CalibrationData, calibration_data, prefetched
from compiler.core.errors import CalibrationError
from compiler.core.settings import ImagePreprocessing
from compiler.core.specs import ModelSpec, parse_dim_range, parse_input_spec

IMAGES = ModelSpec((parse_input_spec("images:Bx1x8x8"),))
RGB = ModelSpec((parse_input_spec("images:Bx3x32x32"),))
TOKENS = ModelSpec((parse_input_spec("input_ids:BxS:int64"), parse_input_spec("attention_mask:BxS:int64")),
                   dict([parse_dim_range("S=1:16:32")]))


def _images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 1, 8, 8)).astype(np.float32)


def _tokens(n: int, s: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((n, s), np.int64)
    mask[0, s // 2:] = 0  # some padding
    return {"input_ids": rng.integers(0, 100, (n, s)), "attention_mask": mask}


def _batch_shapes(data: CalibrationData, name: str) -> list[tuple[int, ...]]:
    return [b[name].shape for b in data.batches()]


def _error(source: object, spec: ModelSpec = IMAGES, **kwargs: object) -> str:
    with pytest.raises(CalibrationError) as info:
        calibration_data(source, spec, **kwargs)  # type: ignore[arg-type]
    return str(info.value)


# --- formats ----------------------------------------------------------------------------------------------------

def test_npz_batch_file_batches_counts_fingerprints_and_reads_labels(tmp_path: Path) -> None:
    x = _images(10)
    np.savez(tmp_path / "calib.npz", images=x, labels=np.arange(10))
    data = calibration_data(tmp_path / "calib.npz", IMAGES, batch_size=4)
    assert data.samples == 10 and not data.is_random and data.repeatable
    assert _batch_shapes(data, "images") == [(4, 1, 8, 8), (4, 1, 8, 8), (2, 1, 8, 8)]
    np.testing.assert_array_equal(np.concatenate([b["images"] for b in data.batches()]), x)
    np.testing.assert_array_equal(data.labels, np.arange(10))  # type: ignore[arg-type]
    assert next(data.batches()).keys() == {"images"}  # labels never reach the model
    # the fingerprint is of the samples: the same arrays give the same digest, one changed value another
    np.savez(tmp_path / "same.npz", images=x)
    changed = x.copy()
    changed[7, 0, 3, 3] += 1
    np.savez(tmp_path / "changed.npz", images=changed)
    assert calibration_data(tmp_path / "same.npz", IMAGES, batch_size=4).fingerprint == data.fingerprint
    assert calibration_data(tmp_path / "changed.npz", IMAGES, batch_size=4).fingerprint != data.fingerprint
    # re-iterable: each pass reads the file again (the accuracy gate makes several passes)
    assert [b["images"].tolist() for b in data] == [b["images"].tolist() for b in data.batches()]
    assert data.to_dict() == {"source": str(tmp_path / "calib.npz"), "samples": 10, "batch_size": 4,
                              "sha256": data.fingerprint, "random": False}


def test_npy_file_for_a_single_input_model(tmp_path: Path) -> None:
    np.save(tmp_path / "calib.npy", _images(6))
    data = calibration_data(tmp_path / "calib.npy", IMAGES, batch_size=4)
    assert data.samples == 6 and _batch_shapes(data, "images") == [(4, 1, 8, 8), (2, 1, 8, 8)]
    np.save(tmp_path / "ids.npy", np.zeros((4, 8), np.int64))
    message = _error(tmp_path / "ids.npy", TOKENS, batch_size=2)
    assert "holds one array" in message and ".npz files keyed by input name" in message


def test_folder_of_single_sample_npz_files_in_name_order(tmp_path: Path) -> None:
    x = _images(5)
    for i in range(5):
        np.savez(tmp_path / f"{i:02d}.npz", images=x[i])  # rank 3: one sample per file
    (tmp_path / "README.txt").write_text("ignored")
    data = calibration_data(tmp_path, IMAGES, batch_size=2)
    assert data.samples == 5 and _batch_shapes(data, "images") == [(2, 1, 8, 8), (2, 1, 8, 8), (1, 1, 8, 8)]
    np.testing.assert_array_equal(np.concatenate([b["images"] for b in data.batches()]), x)


def test_folder_of_images_resized_cropped_and_normalized(tmp_path: Path) -> None:
    image = pytest.importorskip("PIL.Image")
    colors = [(255, 0, 0), (0, 128, 255), (10, 20, 30)]
    for i, color in enumerate(colors):
        image.new("RGB", (48, 40), color).save(tmp_path / f"img{i}.png")  # not square, not 32x32
    image.new("L", (40, 40), 200).save(tmp_path / "gray.png")  # converted to RGB
    prep = ImagePreprocessing(mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    data = calibration_data(tmp_path, RGB, batch_size=2, image=prep)
    assert data.samples == 4 and "4 images" in data.description
    x = np.concatenate([b["images"] for b in data.batches()])
    assert x.shape == (4, 3, 32, 32) and x.dtype == np.float32
    want = (np.array([(200, 200, 200), *colors], np.float32) / 255 - 0.5) / 0.25  # gray.png sorts first
    np.testing.assert_allclose(x.mean(axis=(2, 3)), want, atol=1e-5)
    np.testing.assert_allclose(x.std(axis=(2, 3)), 0, atol=1e-5)  # a flat image stays flat
    # a one-channel model input reads images as grayscale
    gray = calibration_data(tmp_path, IMAGES, batch_size=2)
    assert next(gray.batches())["images"].shape == (2, 1, 8, 8)


def test_images_need_a_crop_when_height_and_width_are_dynamic(tmp_path: Path) -> None:
    image = pytest.importorskip("PIL.Image")
    image.new("RGB", (20, 20)).save(tmp_path / "a.png")
    spec = ModelSpec((parse_input_spec("images:Bx3xHxW"),), dict([parse_dim_range("H=8:16:64"),
                                                                  parse_dim_range("W=8:16:64")]))
    assert "calibration.image.crop" in _error(tmp_path, spec, batch_size=1)
    data = calibration_data(tmp_path, spec, batch_size=1, image=ImagePreprocessing(crop=(16, 12)))
    assert _batch_shapes(data, "images") == [(1, 3, 16, 12)]


def test_calib_loader_module_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_calib_loader.py").write_text(textwrap.dedent("""
        import numpy as np

        def batches():
            rng = np.random.default_rng(0)
            yield {"images": rng.standard_normal((3, 1, 8, 8)).astype(np.float32)}  # a batch
            yield {"images": rng.standard_normal((1, 8, 8)).astype(np.float32)}  # one sample

        def not_dicts():
            yield [1, 2, 3]
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    data = calibration_data(None, IMAGES, loader="my_calib_loader:batches", batch_size=2)
    assert data.samples == 4 and data.description == "--calib-loader my_calib_loader:batches"
    assert not data.repeatable  # a function may shuffle: the accuracy gate holds its batches instead of re-reading
    assert _batch_shapes(data, "images") == [(2, 1, 8, 8), (2, 1, 8, 8)]
    assert "item 0 is a list, not a dict" in _error(None, loader="my_calib_loader:not_dicts", batch_size=1)
    assert "cannot load it" in _error(None, loader="my_calib_loader:nope", batch_size=1)
    assert "cannot load it" in _error(None, loader="no_such_module_xyz:fn", batch_size=1)
    assert "not both" in _error(tmp_path, loader="my_calib_loader:batches")


def test_max_samples_caps_what_is_read(tmp_path: Path) -> None:
    np.savez(tmp_path / "a.npz", images=_images(8, seed=1))
    np.savez(tmp_path / "b.npz", images=_images(8, seed=2))
    data = calibration_data(tmp_path, IMAGES, batch_size=4, max_samples=6)
    assert data.samples == 6 and _batch_shapes(data, "images") == [(4, 1, 8, 8), (2, 1, 8, 8)]
    np.savez(tmp_path / "labels.npz", images=_images(2), labels=np.arange(2))
    assert len(calibration_data(tmp_path / "labels.npz", IMAGES, batch_size=1, max_samples=1).labels) == 1  # type: ignore[arg-type]


def test_a_change_of_sequence_length_starts_a_new_batch(tmp_path: Path) -> None:
    for i, (n, s) in enumerate([(3, 8), (2, 12), (5, 8), (1, 32)]):
        np.savez(tmp_path / f"{i}.npz", **_tokens(n, s, seed=i))
    data = calibration_data(tmp_path, TOKENS, batch_size=4)
    assert data.samples == 11
    assert _batch_shapes(data, "input_ids") == [(3, 8), (2, 12), (4, 8), (1, 8), (1, 32)]
    for batch in data.batches():  # every input of a batch has the same length
        assert batch["input_ids"].shape == batch["attention_mask"].shape


def test_random_data_warns_of_integer_inputs_it_fills_with_zeros(caplog: pytest.LogCaptureFixture) -> None:
    """Random data names each integer input it fills with zeros (no value range, not a mask) and the --input form
    that gives it a range, and says nothing of a mask or an input with a range; the zeros are what every sample
    holds."""
    spec = ModelSpec((parse_input_spec("input_ids:BxS:int64"), parse_input_spec("attention_mask:BxS:int64"),
                      parse_input_spec("token_type_ids:BxS:int64[0,2)")), dict([parse_dim_range("S=1:8:16")]))
    with caplog.at_level("WARNING", logger="calibration.data"):
        data = calibration_data("random", spec, batch_size=2, max_samples=4)
    warned = [r.getMessage() for r in caplog.records if "zeros in every sample" in r.getMessage()]
    assert len(warned) == 1 and "input input_ids " in warned[0] and "--input input_ids:BxS:int64[0,N)" in warned[0]
    batch = next(iter(data.batches()))
    assert not batch["input_ids"].any() and batch["attention_mask"].all()


def test_random_data_is_marked_and_seeded() -> None:
    data = calibration_data("random", IMAGES, batch_size=4, max_samples=8)
    assert data.is_random and data.samples == 8 and data.to_dict()["random"] is True
    assert calibration_data("random", IMAGES, batch_size=4, max_samples=8).fingerprint == data.fingerprint


# --- rejections -------------------------------------------------------------------------------------------------

def test_missing_input_name(tmp_path: Path) -> None:
    np.savez(tmp_path / "calib.npz", pixels=_images(4))
    message = _error(tmp_path / "calib.npz", batch_size=2)
    assert "calib.npz" in message and "no array for input 'images'" in message and "it has pixels" in message
    np.savez(tmp_path / "half.npz", input_ids=np.zeros((2, 8), np.int64))
    assert "no array for input 'attention_mask'" in _error(tmp_path / "half.npz", TOKENS, batch_size=1)


def test_wrong_shape_names_the_sample_and_dimension(tmp_path: Path) -> None:
    np.savez(tmp_path / "calib.npz", images=np.zeros((4, 1, 8, 9), np.float32))
    message = _error(tmp_path / "calib.npz", batch_size=2)
    assert message.startswith("calib.npz[0]: input 'images' has shape (1, 8, 9)") and "dimension 2 must be 8" in message
    np.savez(tmp_path / "rank.npz", images=np.zeros((4, 64), np.float32))
    assert "expected one sample shaped 1x8x8" in _error(tmp_path / "rank.npz", batch_size=2)
    np.savez(tmp_path / "long.npz", **_tokens(2, 40))
    assert "dimension S=40 is outside its range 1:16:32" in _error(tmp_path / "long.npz", TOKENS, batch_size=1)


def test_wrong_dtype_says_how_to_convert(tmp_path: Path) -> None:
    np.savez(tmp_path / "calib.npz", images=_images(4).astype(np.float64))
    message = _error(tmp_path / "calib.npz", batch_size=2)
    assert "input 'images' is float64, the model takes float32" in message and ".astype('float32')" in message


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_or_inf_names_the_sample(tmp_path: Path, bad: float) -> None:
    x = _images(6)
    x[3, 0, 2, 2] = bad
    np.savez(tmp_path / "calib.npz", images=x)
    message = _error(tmp_path / "calib.npz", batch_size=2)
    assert message.startswith("calib.npz[3]: input 'images' holds NaN or Inf"), message


def test_fewer_samples_than_one_batch_shrink_the_batch(tmp_path: Path) -> None:
    """Three samples with --calib-batch 16: the data open with batches of 3 (one batch of all three samples)."""
    np.savez(tmp_path / "calib.npz", images=_images(3))
    data = calibration_data(tmp_path / "calib.npz", IMAGES, batch_size=16)
    assert data.batch_size == 3 and data.samples == 3
    assert [b["images"].shape[0] for b in data.batches()] == [3]


def test_nonexistent_path_empty_folder_and_other_files(tmp_path: Path) -> None:
    assert "no such calibration data" in _error(tmp_path / "missing.npz")
    (tmp_path / "empty").mkdir()
    assert "holds no .npz/.npy files or images" in _error(tmp_path / "empty")
    (tmp_path / "calib.csv").write_text("1,2,3\n")
    assert "must be .npz or .npy" in _error(tmp_path / "calib.csv")
    (tmp_path / "broken.npz").write_bytes(b"not a zip")
    assert "broken.npz: not a readable numpy file" in _error(tmp_path / "broken.npz", batch_size=1)
    np.savez(tmp_path / "whole.npz", images=_images(4))
    whole = (tmp_path / "whole.npz").read_bytes()
    (tmp_path / "truncated.npz").write_bytes(whole[: len(whole) // 2])
    assert "truncated.npz: not a readable numpy file" in _error(tmp_path / "truncated.npz", batch_size=1)
    message = _error(tmp_path / "whole.npz", batch_size=1, labels=tmp_path / "missing_labels.npy")
    assert "no such labels file" in message


def test_no_data_at_all_and_bad_counts() -> None:
    message = _error(None)
    assert "no calibration data" in message and "--calib-data" in message and "--calib-loader" in message
    assert "at least 1" in _error("random", batch_size=0)


def test_labels_must_cover_the_samples(tmp_path: Path) -> None:
    np.savez(tmp_path / "eval.npz", images=_images(6), labels=np.arange(4))
    assert "4 labels for 6 samples" in _error(tmp_path / "eval.npz", batch_size=2)
    np.savez(tmp_path / "nolabels.npz", images=_images(6))
    assert "no 'targets' array" in _error(tmp_path / "nolabels.npz", batch_size=2, labels="targets")


def test_prefetched_reads_one_item_ahead_in_order_and_stops_when_closed() -> None:
    """``prefetched`` gives the source's items in order and unchanged; while the caller holds item 0 the source is
    already making item 1 in another thread (so reading overlaps the caller's runs); a caller that stops after one
    item ends the thread, and the source's own cleanup runs, before the iterator's close returns."""
    started: list[threading.Event] = [threading.Event() for _ in range(4)]
    threads: set[str] = set()
    cleaned = threading.Event()

    def source() -> Iterator[int]:
        try:
            for i in range(4):
                started[i].set()
                threads.add(threading.current_thread().name)
                yield i * 10
        finally:
            cleaned.set()

    assert list(prefetched(source(), "item")) == [0, 10, 20, 30] and threads == {"trtc-data-prefetch"}
    for event in started:
        event.clear()
    cleaned.clear()
    items = prefetched(source(), "item")
    assert next(items) == 0
    assert started[1].wait(5)  # item 1 is being made while the caller holds item 0
    items.close()
    assert cleaned.is_set() and not any(t.name == "trtc-data-prefetch" for t in threading.enumerate())
    assert not started[2].is_set()  # never more than one item ahead


def test_prefetched_raises_the_sources_error_at_the_item_where_it_happened() -> None:
    """An exception in the source reaches the caller as the same exception, after the items made before it."""
    def source() -> Iterator[int]:
        yield 1
        yield 2
        raise CalibrationError("sample 2: broken")

    got: list[int] = []
    with pytest.raises(CalibrationError, match="sample 2: broken"):
        for item in prefetched(source(), "item"):
            got.append(item)
    assert got == [1, 2]


def test_batches_are_the_same_with_and_without_the_read_ahead(tmp_path: Path) -> None:
    """A pass of ``batches()`` (read ahead) gives exactly the batches that the unprefetched pass gives, for a file
    source and for random data, and two passes give the same values."""
    spec = ModelSpec((parse_input_spec("x:Bx3x4x4"),))
    np.savez(tmp_path / "d.npz", x=np.arange(10 * 48, dtype=np.float32).reshape(10, 3, 4, 4))
    for source in (str(tmp_path / "d.npz"), "random"):
        data = calibration_data(source, spec, batch_size=4, max_samples=10)
        plain = [b["x"] for b in data._batches()]
        for _ in range(2):
            ahead = [b["x"] for b in data.batches()]
            assert [a.shape for a in ahead] == [(4, 3, 4, 4), (4, 3, 4, 4), (2, 3, 4, 4)]
            assert all(np.array_equal(a, p) for a, p in zip(ahead, plain, strict=True))
