from pathlib import Path

import pytest
from tests.closed_forms import FLAT

from ballonet import calibration

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture
def real_data() -> Path:
    """The repository's measured data (data/README.md: document lengths, H100 timings)."""
    assert DATA.is_dir(), f"the repository's data folder is missing: {DATA}"
    return DATA


@pytest.fixture
def flat_profile():
    """The closed forms' calibration profile (`closed_forms.FLAT`) installed for the test."""
    with calibration.use(FLAT):
        yield
