from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture
def real_data() -> Path:
    """The repository's measured data (data/README.md: document lengths, H100 timings)."""
    assert DATA.is_dir(), f"the repository's data folder is missing: {DATA}"
    return DATA
