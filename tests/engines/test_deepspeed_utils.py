"""DeepSpeed helpers: the logger level polynya sets when it imports DeepSpeed."""
import logging

import pytest

deepspeed = pytest.importorskip("deepspeed")

from polynya.engines._deepspeed import _quiet_logger, import_deepspeed  # noqa: E402


@pytest.fixture
def restore_level():
    level = deepspeed.utils.logger.level
    yield
    deepspeed.utils.logger.setLevel(level)


def test_deepspeed_info_logging_is_off_by_default(monkeypatch, restore_level):
    monkeypatch.delenv("POLYNYA_DEEPSPEED_LOG", raising=False)
    deepspeed.utils.logger.setLevel(logging.INFO)
    import_deepspeed()
    assert deepspeed.utils.logger.level == logging.WARNING


def test_deepspeed_log_level_from_environment(monkeypatch, restore_level):
    monkeypatch.setenv("POLYNYA_DEEPSPEED_LOG", "info")
    _quiet_logger(deepspeed)
    assert deepspeed.utils.logger.level == logging.INFO
    monkeypatch.setenv("POLYNYA_DEEPSPEED_LOG", "loud")
    with pytest.raises(ValueError, match="POLYNYA_DEEPSPEED_LOG='loud'"):
        _quiet_logger(deepspeed)
    assert deepspeed.utils.logger.level == logging.INFO  # unchanged by the bad value
