"""Fixtures shared by several test files."""

from __future__ import annotations

from pathlib import Path

import pytest

HF_FIXTURES = Path(__file__).parent / "fixtures"  # tiny Hugging Face models, see fixtures/make_reference.py


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """converted(family, dtype="float32") -> jaxserve checkpoint of tests/fixtures/<family>/hf, made once a session."""
    from jaxserve.convert import convert

    root = tmp_path_factory.mktemp("converted")
    done: dict[tuple[str, str], Path] = {}

    def convert_once(family: str, dtype: str = "float32") -> Path:
        if (family, dtype) not in done:
            done[family, dtype] = convert(HF_FIXTURES / family / "hf", root / f"{family}-{dtype}", dtype=dtype,
                                          progress=False)
        return done[family, dtype]

    return convert_once
