"""Public names renamed so that each word has one meaning (issue 21, item 6; CHANGELOG) keep working
under their former names: ``blockshard.semantics.ByteStream`` (now ``ByteSection``: "stream" is a
CUDA stream), ``QuantizedStorage(streams=...)`` and ``.streams`` (now ``sections``), and
``blockshard.runtime.TensorOwners`` (now ``TensorOwnerPlan``: an owner is a rank)."""

from __future__ import annotations

import pytest

from blockshard import SemanticsError
from blockshard.semantics import ByteSection, ByteStream, QuantizedStorage


def test_byte_stream_is_byte_section_and_streams_is_sections():
    assert ByteStream is ByteSection
    payload = ByteSection("payload", 64, 32)
    new = QuantizedStorage("fmt", 128, 64, (payload,))
    old = QuantizedStorage("fmt", 128, 64, streams=(payload,))
    assert old == new and hash(old) == hash(new)
    assert old.sections == old.streams == (payload,)
    assert QuantizedStorage("fmt", 128, 64, sections=(payload,)) == new


def test_quantized_storage_takes_its_sections_once_and_still_checks_them():
    payload = ByteSection("payload", 64, 32)
    with pytest.raises(TypeError, match="takes the byte sections once"):
        QuantizedStorage("fmt", 128, 64, (payload,), streams=(payload,))
    with pytest.raises(TypeError, match="takes the byte sections once"):
        QuantizedStorage("fmt", 128, 64)
    with pytest.raises(SemanticsError, match="section 'payload' of 16 bytes"):  # the control: checked as before
        QuantizedStorage("fmt", 128, 64, streams=(ByteSection("payload", 16, 32),))


def test_tensor_owners_is_tensor_owner_plan():
    import blockshard.runtime as runtime

    assert runtime.TensorOwners is runtime.TensorOwnerPlan
    assert {"TensorOwners", "TensorOwnerPlan"} <= set(runtime.__all__)
